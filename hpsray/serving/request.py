"""A prediction request: JSON ``{"examples": [{"<column>": value, ...}, ...]}`` → a :class:`Batch`.

The columns are those of the training schema (the export's ``input``): every dense and every
categorical column must be present in every example, and no other. Values:

- dense: a number, or ``null`` (missing: 0, as in training); then the schema's dense transform;
- categorical: an integer (used as the integer itself, like a Parquet integer column), a string
  (encoded as the schema says, like a text file: ``string`` hashes it, ``hex``/``int`` parse it),
  a list of those (multi-hot), or ``null``/``[]`` (no key). A string holding the schema's
  ``multi_hot_separator`` is split as in training.

Raw values become keys through the readers' own :class:`~hpsray.data.convert.Converter`, so a
request gives exactly the keys training gave the same raw values. Anything else raises
:class:`BadRequest` naming the example, column and reason.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa

from hpsray.data.batch import Batch
from hpsray.data.convert import Converter
from hpsray.data.keys import slot_salt
from hpsray.data.schema import Schema
from hpsray.errors import BadRequest, ServingError
from hpsray.kernels.hashing import EMPTY_KEY, mix64_array

__all__ = ["InputSpec", "Limits", "RequestParser"]

try:  # 5-10x faster than the json module on request bodies; refuses NaN/Infinity as JSON does
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - orjson comes with the serve extra

    def _loads(body: bytes) -> Any:
        return json.loads(body, parse_constant=_reject_constant)


_LABEL = "__hpsray_label__"
_DENSE_TYPES = (pa.int64(), pa.float64(), pa.null())
_CAT_SCALARS = (pa.int64(), pa.uint64(), pa.string(), pa.null())


@dataclass(frozen=True)
class Limits:
    """Bounds on one request: body bytes and examples."""

    max_body_bytes: int = 1 << 20
    max_examples: int = 1024

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_examples < 1:
            raise ValueError(f"limits must be >= 1, got {self}")


@dataclass(frozen=True)
class InputSpec:
    """The raw inputs of a model: the export manifest's ``input`` entry."""

    dense: tuple[str, ...]
    categorical: tuple[str, ...]
    encoding: str = "string"
    multi_hot_separator: str = ""
    dense_transform: str = "none"

    @staticmethod
    def from_manifest(manifest: dict, where: str = "manifest.json") -> InputSpec:
        spec = manifest.get("input")
        if not isinstance(spec, dict):
            raise ServingError(
                f"{where}: no 'input' entry (exported before serving existed, or without a schema); "
                "re-export with the data schema (hpsray.export.export(schema=...))"
            )
        return InputSpec(
            tuple(spec["dense"]),
            tuple(spec["categorical"]),
            spec.get("encoding", "string"),
            spec.get("multi_hot_separator", ""),
            spec.get("dense_transform", "none"),
        )

    @property
    def columns(self) -> tuple[str, ...]:
        return (*self.dense, *self.categorical)


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number JSON allows")


def _getter(names: tuple[str, ...]) -> Callable[[dict], tuple]:
    """``example -> tuple of its values of names`` (a 1-tuple for one name, ``()`` for none)."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    if len(names) == 1:
        name = names[0]
        return lambda ex: (ex[name],)
    return lambda ex: ()


def _kind(v: object) -> str:
    return "null" if v is None else type(v).__name__


class RequestParser:
    """Checks and converts request bodies for one model (see the module docstring)."""

    def __init__(self, spec: InputSpec, limits: Limits = Limits()) -> None:
        self.spec, self.limits = spec, limits
        self._columns = frozenset(spec.columns)
        schema = Schema(
            format="parquet",
            label=_LABEL,
            dense=spec.dense,
            categorical=spec.categorical,
            encoding=spec.encoding,
            multi_hot_separator=spec.multi_hot_separator,
            dense_transform=spec.dense_transform,
            delimiter="\t" if spec.multi_hot_separator != "\t" else ",",
        )  # unused: no text here
        self._converter = Converter(schema, [_LABEL, *spec.columns])
        self._row = _getter(spec.columns)
        self._dense_row, self._cat_row = _getter(spec.dense), _getter(spec.categorical)
        self._salts = slot_salt(np.arange(len(spec.categorical)))
        self.fast = True  # the integer fast paths (tests switch them off to compare with the converter)
        self.vector = True  # the first of them (tests switch it off to compare with the second)

    def _vector_batch(self, examples: list) -> Batch | None:
        """The batch straight from the decoded examples, when every example is an object of
        exactly the model's columns, every categorical value one integer of the int64 range and
        every dense value a number (the common case: a client sending what a Parquet-trained
        model reads); ``None`` otherwise, and the checked path (:meth:`parse_examples`) decides.

        Two row gathers (``operator.itemgetter`` over the examples), one type census of all values
        (``set(map(type, ...))``, so a ``bool``, string, float or null anywhere leaves this path)
        and one ``np.fromiter`` per block: no Python-level work per value (a quarter of the
        per-column pyarrow conversion's cost). Bit-equal to the converter: keys are
        mix64(value ^ slot salt), the empty marker moved down by one; dense values go to float32
        through float64, which is exact for integers while their magnitude is below 2**53 (larger
        ones take the checked path), then the dense transform.
        """
        n = len(examples)
        if not n or not self.spec.categorical:
            return None
        try:
            if set(map(len, examples)) != {len(self._columns)}:
                return None
            dense_rows = list(map(self._dense_row, examples))  # KeyError: a column missing
            cat_rows = list(map(self._cat_row, examples))  # TypeError: an example that is no object
        except (KeyError, TypeError):
            return None
        if set(map(type, chain.from_iterable(cat_rows))) != {int}:
            return None
        dense_types = set(map(type, chain.from_iterable(dense_rows)))
        if not dense_types <= {int, float}:
            return None
        n_slots, n_dense = len(self.spec.categorical), len(self.spec.dense)
        try:
            values = np.fromiter(chain.from_iterable(cat_rows), np.int64, n * n_slots)
            block = np.fromiter(chain.from_iterable(dense_rows), np.float64, n * n_dense)
        except OverflowError:  # integers past int64: the checked path (uint64 values, or a 400)
            return None
        if int in dense_types and not np.all(np.abs(block) < 2.0**53):
            return None  # an integer whose float64 is inexact: the converter casts int64 to float32 directly
        x = block.astype(np.float32).reshape(n, n_dense)
        if not np.isfinite(x).all():
            return None  # the converter names the bad value
        keys = mix64_array(values.view(np.uint64).reshape(n, n_slots) ^ self._salts).reshape(-1)
        keys[keys == EMPTY_KEY] = EMPTY_KEY - np.uint64(1)
        if self.spec.dense_transform == "log1p" and x.size:
            np.log1p(np.maximum(x, 0, out=x), out=x)
        offsets = np.arange(0, n * n_slots + 1, n_slots, dtype=np.int64)
        slots = np.tile(np.arange(n_slots, dtype=np.int32), n)
        return Batch(np.zeros(n, np.float32), x, keys, offsets, slots, n_slots)

    def _integer_batch(self, dense: list[pa.Array], cats: list[pa.Array], n: int) -> Batch | None:
        """The batch, without the converter, when every categorical value is one integer and every
        dense value a finite number (the common case of Parquet-trained models); ``None`` otherwise.

        Same arithmetic as the converter's integer path: key = mix64(value ^ slot salt), the empty
        marker moved down by one; dense values cast to float32, then the dense transform.
        """
        if not cats or any(a.type not in (pa.int64(), pa.uint64()) or a.null_count for a in cats):
            return None
        if any(a.type not in (pa.int64(), pa.float64()) or a.null_count for a in dense):
            return None
        n_slots = len(cats)
        values = np.empty((n, n_slots), np.uint64)
        for j, a in enumerate(cats):
            values[:, j] = a.to_numpy().view(np.uint64)
        keys = mix64_array(values ^ self._salts).reshape(-1)
        keys[keys == EMPTY_KEY] = EMPTY_KEY - np.uint64(1)
        x = np.empty((n, len(dense)), np.float32)
        with np.errstate(over="ignore"):  # a value past float32 becomes inf, found just below
            for j, a in enumerate(dense):
                x[:, j] = a.to_numpy()
        if not np.isfinite(x).all():
            return None  # the converter names the bad value
        if self.spec.dense_transform == "log1p" and x.size:
            np.log1p(np.maximum(x, 0, out=x), out=x)
        offsets = np.arange(0, n * n_slots + 1, n_slots, dtype=np.int64)
        slots = np.tile(np.arange(n_slots, dtype=np.int32), n)
        return Batch(np.zeros(n, np.float32), x, keys, offsets, slots, n_slots)

    def parse_body(self, body: bytes) -> Batch:
        """The batch of a JSON body; :class:`BadRequest` with the reason otherwise."""
        if len(body) > self.limits.max_body_bytes:
            raise BadRequest(f"body of {len(body)} bytes exceeds the limit of {self.limits.max_body_bytes}")
        try:
            doc = _loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"body is not JSON: {e}") from None
        if not isinstance(doc, dict) or "examples" not in doc:
            raise BadRequest('body must be a JSON object {"examples": [...]}')
        extra = set(doc) - {"examples"}
        if extra:
            raise BadRequest(f"unknown top-level field(s) {sorted(extra)}; only 'examples' is accepted")
        return self.parse_examples(doc["examples"])

    def parse_examples(self, examples: object) -> Batch:
        """The batch of a list of examples (dicts of column → raw value)."""
        if not isinstance(examples, list):
            raise BadRequest(f"'examples' must be a list, got {_kind(examples)}")
        if len(examples) > self.limits.max_examples:
            raise BadRequest(f"{len(examples)} examples exceed the limit of {self.limits.max_examples} per request")
        if self.fast and self.vector:
            batch = self._vector_batch(examples)
            if batch is not None:
                return batch
        cols = self._columns
        for i, ex in enumerate(examples):
            if not isinstance(ex, dict):
                raise BadRequest(f"examples[{i}] must be an object of column: value, got {_kind(ex)}")
            if ex.keys() != cols:
                missing = sorted(cols - ex.keys())
                if missing:
                    raise BadRequest(f"examples[{i}]: missing column(s) {missing}")
                raise BadRequest(
                    f"examples[{i}]: unknown column(s) {sorted(ex.keys() - cols)} "
                    f"(the model's columns: {list(self.spec.columns)})"
                )
        n = len(examples)
        columns = list(zip(*map(self._row, examples))) if n else [() for _ in self.spec.columns]
        n_dense = len(self.spec.dense)
        dense = [self._dense_column(name, list(v)) for name, v in zip(self.spec.dense, columns[:n_dense])]
        cats = [self._categorical_column(name, list(v)) for name, v in zip(self.spec.categorical, columns[n_dense:])]
        if self.fast:
            batch = self._integer_batch(dense, cats, n)
            if batch is not None:
                return batch
        arrays = {_LABEL: pa.array(np.zeros(n, np.float32))}
        arrays.update(zip(self.spec.dense, dense))
        arrays.update(zip(self.spec.categorical, cats))
        table = pa.RecordBatch.from_pydict(arrays)
        try:
            converted = self._converter.convert(table)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:  # e.g. a dense integer past float32's exact range
            raise BadRequest(f"a value the model's inputs cannot take: {e}") from None
        if converted.bad_index.size:
            row = int(converted.bad_index[0])
            why = self._converter.describe(table, row, converted.bad_reason[0])
            raise BadRequest(f"examples[{row}]: {why}")
        return converted.batch

    @staticmethod
    def _first_wrong(values: list, ok: Callable[[object], bool]) -> str:
        for i, v in enumerate(values):
            if not ok(v):
                return f"examples[{i}] has {v!r} ({_kind(v)})"
        return "mixed value types"

    def _dense_column(self, name: str, values: list) -> pa.Array:
        def ok(v: object) -> bool:
            return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))

        try:
            arr = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            arr = None
        if arr is None or arr.type not in _DENSE_TYPES:
            raise BadRequest(f"dense column {name!r} takes numbers (or null): {self._first_wrong(values, ok)}")
        return arr

    def _categorical_column(self, name: str, values: list) -> pa.Array:
        def scalar_ok(v: object) -> bool:
            return v is None or isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))

        def ok(v: object) -> bool:
            return scalar_ok(v) or (isinstance(v, list) and all(x is not None and scalar_ok(x) for x in v))

        try:
            arr = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            try:  # integers past int64: the uint64 range
                arr = pa.array(values, type=pa.uint64())
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
                arr = None
        t = None if arr is None else arr.type
        if t is not None and (pa.types.is_list(t) or pa.types.is_large_list(t)):
            if arr.values.null_count or t.value_type not in _CAT_SCALARS:
                t = None
        elif t not in _CAT_SCALARS:
            t = None
        if t is None:
            raise BadRequest(
                f"categorical column {name!r} takes a string, an integer or a list of them (or null): "
                f"{self._first_wrong(values, ok)}"
            )
        return arr
