"""Conformance checks of compress plugins (API 1.9's ``Compressor``), as ``lmlab compress`` drives them.

The method compresses a tiny core ``LanguageModel`` (the kit's reference attention and ffn, d_model
128 so that group sizes of 32, 64 and 128 divide its layers; pass ``model``, a callable returning a
fresh seeded model, for a method that needs a particular mixer, e.g. head pruning's ``gqa``), with
random calibration windows when it declares ``calibrated``. Then:

``reload``       the record is plain JSON; the state dict, saved and loaded with ``weights_only``, loads
                 strictly into a fresh model that ``restructure`` gave the record's structure, which
                 computes the compressed model's outputs exactly
``bad_options``  the Options refuse an unknown key and a wrong type, naming the option; each int option
                 at the ends of its declared range (or 10**6 where it has none; ``ranges={"grid": (2, 20)}``
                 states the range to use instead, where the declared one is slow) is either refused by
                 ``check_model`` with a UserError naming ``compress.<name>.<option>``, the model
                 untouched, or compresses without any other exception
``size``         the figures the summary reports about size are those of the tensors saved:
                 ``bits_per_weight`` and ``linear_bytes_ratio`` (over the modules the record lists in
                 ``modules``), ``params``, ``nonzero_params``, ``sparsity`` in [0, 1]; and a method
                 that claims fewer bytes saves fewer
"""

import io
import json
import math

import pydantic
import torch
from torch import nn

from lmlab.api import Calibration, Compressor, ModelShape, UserError
from lmlab.testing import generic
from lmlab.testing.common import SAME, Subject, expect_close, fail

#: d_model 128: the common group sizes divide every linear layer, the head and embedding stay small.
COMPRESS_SHAPE = ModelShape(n_layers=2, d_model=128, n_heads=4, block_size=16, vocab_size=37)


class CompressSubject(Subject):
    slot = "compress"
    module_type = Compressor

    def __init__(self, plugin, options=None, *, model=None, **settings):
        settings.setdefault("shape", COMPRESS_SHAPE)
        super().__init__(plugin, options, **settings)
        self.make_model = model

    def model(self) -> nn.Module:
        """A fresh, seeded, float32 model in eval mode, as ``lmlab compress`` hands it to a method."""
        with self.seeded(self.seed):
            if self.make_model is not None:
                model = self.make_model()
            else:
                from lmlab.testing.reference import ReferencePosition, reference_model

                model = reference_model(self.shape, ReferencePosition())
        return model.to(self.device).float().eval()

    def calibration(self) -> Calibration | None:
        if not getattr(self.cls, "calibrated", False):
            return None
        windows = self.randint(self.shape.vocab_size, 8, self.shape.block_size + 1, seed=self.seed + 3)
        return Calibration(windows, batch_size=4)

    def probe(self) -> torch.Tensor:
        return self.randint(self.shape.vocab_size, 2, self.shape.block_size, seed=self.seed + 1)

    def compressed(self, plugin: Compressor | None = None) -> tuple[nn.Module, dict]:
        """(model, record) after ``compress``, the record checked to be plain JSON."""
        model, plugin = self.model(), plugin or self.plugin()
        plugin.check_model(model)
        record = plugin.compress(model, self.calibration())
        if not isinstance(record, dict):
            fail(f"compress returned a {type(record).__name__}, not a dict (the record restructure reads)")
        try:
            if json.loads(json.dumps(record)) != record:
                raise TypeError("it changes when written as JSON and read back (tuples, non-str keys)")
        except (TypeError, ValueError) as exc:
            fail(f"the record compress returned is not plain JSON: {exc}")
        return model, record


def reload(subject: CompressSubject) -> None:
    """``torch.save`` of the compressed state dict, ``torch.load(weights_only=True)``, loaded strictly
    into a fresh model given the record's structure by ``restructure``: the same outputs exactly (a
    method whose loaded model computes otherwise would serve another model than it measured)."""
    model, record = subject.compressed()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    try:
        state = torch.load(buffer, weights_only=True)
    except Exception as exc:
        fail(f"the compressed state dict does not load with weights_only=True (hold plain tensors): {exc}")
    fresh = subject.model()
    subject.plugin().restructure(fresh, json.loads(json.dumps(record)))
    try:
        fresh.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        fail(f"the compressed state dict does not load strictly into a model restructured from the record: "
             f"{' '.join(str(exc).split())[:400]}")
    fresh.eval()
    with torch.no_grad():
        expect_close(fresh(subject.probe()), model(subject.probe()), SAME,
                     "the reloaded model (restructure, then load_state_dict) computes other logits than the "
                     "compressed one")


def bad_options(subject: CompressSubject) -> None:
    """Options refuse an unknown key and a wrong type; each int option at the ends of its range is
    refused by ``check_model`` (UserError naming ``compress.<name>.<option>``, the model untouched) or
    compresses without any exception but a UserError raised before the model changed."""
    cls = subject.cls
    for bad, what in (({"no_such_option": 1}, "an unknown option"),):
        try:
            cls.Options(**bad)
        except pydantic.ValidationError:
            pass
        else:
            fail(f"{cls.Options.__name__} accepted {what} ({bad!r}): a typo in a manifest would be ignored")
    fields = cls.Options.model_fields
    for name, value in subject.options.model_dump().items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                cls.Options(**{**subject.options.model_dump(), name: "not-a-number"})
            except pydantic.ValidationError as exc:
                if name not in str(exc):
                    fail(f"the refusal of {name} = 'not-a-number' does not name {name}: {exc}")
            else:
                fail(f"{cls.Options.__name__} accepted {name} = 'not-a-number'")
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if name in subject.ranges:  # the author's stated range: a declared 1000 may cost minutes to search
            ends = subject.ranges[name]
        else:
            ends = _declared_range(fields[name].metadata)
        for end in ends:
            _one_setting(subject, name, end)


def _declared_range(metadata) -> tuple[int, int]:
    """(lowest, highest) int a field's ``ge``/``gt``/``le``/``lt`` allow; 0 and 10**6 where unbounded."""
    def bound(attribute: str, shift: int) -> list[int]:
        return [getattr(m, attribute) + shift for m in metadata if getattr(m, attribute, None) is not None]

    return max(bound("ge", 0) + bound("gt", 1), default=0), min(bound("le", 0) + bound("lt", -1), default=10**6)


def _one_setting(subject: CompressSubject, name: str, value: int) -> None:
    try:
        options = subject.cls.Options(**{**subject.options.model_dump(), name: value})
    except pydantic.ValidationError:
        return  # refused where a manifest is read
    plugin = subject.cls(options)
    model = subject.model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        plugin.check_model(model)
        plugin.compress(model, subject.calibration())
    except UserError as exc:
        if not (exc.key or "").startswith("compress."):
            fail(f"with {name} = {value}: the UserError names {exc.key!r}, not compress.<method>.<option>: {exc}")
        after = model.state_dict()
        if after.keys() != before.keys() or any(not torch.equal(after[k], before[k]) for k in before):
            fail(f"with {name} = {value}: refused ({exc.message}) after changing the model; refuse in "
                 "check_model, before anything is compressed")
    except Exception as exc:
        fail(f"with {name} = {value} (which its Options accept): raised {type(exc).__name__}: {exc}; refuse a "
             "setting the model cannot take with a UserError naming compress.<method>.<option>")


def _saved_bytes(modules) -> int:
    """Bytes of the state of ``modules`` as saved, each storage counted once."""
    seen, total = set(), 0
    for module in modules:
        for t in module.state_dict().values():
            where = (t.untyped_storage().data_ptr(), t.storage_offset())
            if where not in seen:
                seen.add(where)
                total += t.numel() * t.element_size()
    return total


def size(subject: CompressSubject) -> None:
    """The summary's size figures are those of the tensors saved: ``bits_per_weight`` = 8 × the bytes
    of the modules in the record's ``modules`` / their weights' elements, ``linear_bytes_ratio`` = those
    bytes / the same modules' bytes before, ``params`` and ``nonzero_params`` of the whole model,
    ``sparsity`` in [0, 1]; and a method that reports shrinking (a ratio or bits below float32's) saves
    fewer bytes than the model it was given."""
    original = subject.model()
    model, record = subject.compressed()
    summary = record.get("summary") or {}
    if not isinstance(summary, dict) or not all(isinstance(v, (int, float)) and math.isfinite(v)
                                                for v in summary.values()):
        fail(f"the record's summary must map names to finite numbers, got {summary!r}")
    names = record.get("modules")
    if names is not None:
        before = dict(original.named_modules())
        after = dict(model.named_modules())
        missing = [n for n in names if n not in after]
        if missing:
            fail(f"the record's modules name no module of the compressed model: {missing[:3]}")
        saved = _saved_bytes(after[n] for n in names)
        weights = sum(before[n].weight.numel() for n in names if hasattr(before[n], "weight"))
        was = _saved_bytes(before[n] for n in names)
        claims = {"bits_per_weight": 8 * saved / weights if weights else 0.0,
                  "linear_bytes_ratio": saved / was if was else 1.0}
        for key, actual in claims.items():
            if key in summary and not math.isclose(summary[key], actual, rel_tol=1e-3):
                fail(f"the summary reports {key} = {summary[key]:.4g}, the saved tensors of the {len(names)} "
                     f"modules it lists give {actual:.4g}")
    params = {id(p): p for p in model.parameters()}.values()
    counts = {"params": sum(p.numel() for p in params), "nonzero_params": sum(int(p.count_nonzero()) for p in params)}
    for key, actual in counts.items():
        if key in summary and summary[key] != actual:
            fail(f"the summary reports {key} = {summary[key]}, the compressed model has {actual}")
    if "sparsity" in summary and not 0 <= summary["sparsity"] <= 1:
        fail(f"the summary reports sparsity = {summary['sparsity']}, outside [0, 1]")
    shrinks = summary.get("linear_bytes_ratio", 1.0) < 1 or summary.get("bits_per_weight", 32) < 32
    if shrinks and _saved_bytes([model]) >= _saved_bytes([original]):
        fail(f"the summary reports a smaller model, but its state dict holds {_saved_bytes([model])} bytes, "
             f"{_saved_bytes([original])} before")


#: name → check, in the order ``check_compress`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "reload": reload,
    "bad_options": bad_options,
    "size": size,
}
