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
    PrivateControlFlow,
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
        if isinstance(obj, type) and obj is not PrivateControlFlow:
            assert issubclass(obj, HpsrayError), name
    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)
    assert issubclass(ExportError, ValueError) and issubclass(SSDFullError, OSError)
    assert issubclass(CapacityError, RuntimeError) and issubclass(TableFullError, CapacityError)
    assert issubclass(TrainingStopped, RuntimeError) and issubclass(PeerFailedError, RuntimeError)
    assert issubclass(CorruptFileError, SSDError) and issubclass(TooMuchBadInput, DataError)


@pytest.mark.parametrize(
    "package",
    [
        "hpsray.config",
        "hpsray.data",
        "hpsray.kernels",
        "hpsray.pipelines",
        "hpsray.tiers",
        "hpsray.tiers.ssd",
        "hpsray.serving",
    ],
)
def test_errors_have_one_import_path(package):
    """The old homes of the error classes no longer export them: every caller imports them from
    hpsray.errors (issue 26)."""
    import importlib

    module = importlib.import_module(package)
    exported = set(getattr(module, "__all__", ()))
    assert not exported & set(errors.__all__), sorted(exported & set(errors.__all__))


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("job.toml", "model.dim", "must be a positive integer, got 0"),
        DataError("a.csv", "invalid_label", "'x'", line=3),
        TooMuchBadInput("a.csv", "too_much", "1 of 2 files bad"),
        PeerFailedError(7),
        TrainingStopped(ValueError("boom"), 3),
        errors.FaultTimeout("the all-reduce of batch 3", 60.0, ["node 1 is dead"]),
        errors.WorkingSetError(3, 4, 5),
        errors.MissingRowsError(3, 10, 5),
        errors.CheckpointError("/ckpt/000010", "manifest missing"),
        errors.DiskFullError(28, "No space left", directory="/d", needed=10, free=1),
        SSDFullError(28, "No space left", directory="/ssd", needed=10, free=1),
        errors.CheckpointFullError(28, "No space left", directory="/ckpt", needed=3, free=0),
    ],
)
def test_errors_survive_pickling_with_their_message_and_fields(error):
    """One pickling rule for the family (HpsrayError.__reduce__): type, message, every field and
    an OSError's errno survive; Ray ships errors between processes this way."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert repr(vars(back)) == repr(vars(error))
    if isinstance(error, OSError):
        assert (back.errno, back.strerror) == (error.errno, error.strerror)


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


def _hpsray_exception_classes() -> dict[str, type]:
    """Every exception class defined in a module of hpsray (modules that need a GPU library
    this machine lacks are skipped), by qualified name."""
    import importlib
    import inspect
    import pkgutil

    import hpsray

    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(hpsray.__path__, "hpsray."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # CuPy, numba.cuda's driver: the GPU-only modules
            continue
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_exception_hpsray_defines_is_in_the_family_and_its_tree():
    """One family: each exception class hpsray defines derives from HpsrayError, is defined in
    hpsray.errors and is drawn in the tree of its docstring. The only others are a module's
    private control flow: a class with a leading underscore deriving from PrivateControlFlow
    (the stated marker), raised and caught by its module."""
    classes = _hpsray_exception_classes()
    assert "hpsray.errors.FaultTimeout" in classes  # the walk reached the package
    assert {"hpsray.job.validate._Rejected", "hpsray.serving.blockread._Repeated"} <= set(classes)
    tree = errors.__doc__ or ""
    private = {name: cls for name, cls in classes.items() if issubclass(cls, PrivateControlFlow)}
    unmarked = sorted(n for n, c in classes.items() if c.__qualname__.startswith("_") and n not in private)
    assert not unmarked, f"private exceptions must derive from PrivateControlFlow: {unmarked}"
    named = sorted(n for n, c in private.items() if c is not PrivateControlFlow and not c.__qualname__.startswith("_"))
    assert not named, f"a PrivateControlFlow class is private to its module (leading underscore): {named}"
    assert not [c for c in private.values() if issubclass(c, HpsrayError)]
    public = {name: cls for name, cls in classes.items() if name not in private}
    outside = sorted(name for name in public if not name.startswith("hpsray.errors."))
    assert not outside, f"define these in hpsray.errors: {outside}"
    for name, cls in public.items():
        if cls is HpsrayError:
            continue
        assert issubclass(cls, HpsrayError), name
        assert f"── {cls.__name__} " in tree, f"{cls.__name__} is missing from errors.py's tree"
        assert cls.__name__ in errors.__all__, cls.__name__
