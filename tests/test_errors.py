"""The error family: one root, the builtin bases callers catch, pickling (Ray ships errors between actors)."""

import pickle

import pytest

from hpsray import errors
from hpsray.errors import (
    CapacityError,
    ConfigError,
    CorruptFileError,
    DataError,
    ExportError,
    HpsrayError,
    PeerFailedError,
    SSDError,
    SSDFullError,
    TableFullError,
    TooMuchBadInput,
    TrainingStopped,
    caused_by,
)


def test_every_error_is_an_hpsray_error_and_keeps_its_builtin_base():
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, HpsrayError), name
    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)
    assert issubclass(ExportError, ValueError) and issubclass(SSDFullError, OSError)
    assert issubclass(CapacityError, RuntimeError) and issubclass(TableFullError, CapacityError)
    assert issubclass(TrainingStopped, RuntimeError) and issubclass(PeerFailedError, RuntimeError)
    assert issubclass(CorruptFileError, SSDError) and issubclass(TooMuchBadInput, DataError)


def test_old_import_paths_still_give_the_same_classes():
    from hpsray.config import ConfigError as C
    from hpsray.data import DataError as D
    from hpsray.kernels import TableFullError as T
    from hpsray.pipelines import TrainingStopped as S
    from hpsray.tiers import CapacityError as Cap
    from hpsray.tiers import CorruptFileError as Cor
    from hpsray.tiers import SSDError as E
    from hpsray.tiers import SSDFullError as F

    assert (C, D, T, S, Cap, Cor, E, F) == (
        ConfigError,
        DataError,
        TableFullError,
        TrainingStopped,
        CapacityError,
        CorruptFileError,
        SSDError,
        SSDFullError,
    )


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("job.toml", "model.dim", "must be a positive integer, got 0"),
        DataError("a.csv", "invalid_label", "'x'", line=3),
        TooMuchBadInput("a.csv", "too_much", "1 of 2 files bad"),
        PeerFailedError(7),
        TrainingStopped(ValueError("boom"), 3),
    ],
)
def test_errors_survive_pickling_with_their_message(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)


def test_peer_failure_keeps_its_message_and_is_found_through_wrappers():
    e = PeerFailedError(4)
    assert str(e) == "batch 4 failed on another node; see that trainer's error"

    class Wrapper(Exception):  # like ray.exceptions.RayTaskError: the original under .cause
        def __init__(self, cause):
            self.cause = cause

    assert caused_by(Wrapper(e), PeerFailedError)
    assert not caused_by(Wrapper(ValueError("x")), PeerFailedError)
    try:
        raise RuntimeError("outer") from e
    except RuntimeError as outer:
        assert caused_by(outer, PeerFailedError)
