"""A model's state in the arena: which tensors a job holds, in what order, and how they map to a state_dict.

A job holds a model's whole ``state_dict``: the trainable parameters (float32 master weights, whatever the
model's own dtype), the frozen ones (``requires_grad=False``: kept, exported, never updated, and never in a
gradient), and the persistent buffers (BatchNorm statistics, counters: float64 in the arena, so integers are
exact up to 2^53). The spec lists them in arena order: trainable parameters, frozen parameters, then buffers
grouped by dtype (real-valued and boolean ones first: an entry sets those, and adds to the integer
counters after them), so that each group is one contiguous range the learner can copy in one call.

The learner client, the server, the checkpoints and ``psd export`` all go from spec to tensors through here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from psd import _native
from psd.arena import SET_BUFFER_DTYPES, ParamSpec
from psd.errors import SpecError

__all__ = [
    "PARAM_DTYPES",
    "buffer_groups",
    "buffers_view",
    "in_model_dtypes",
    "model_spec",
    "pieces_view",
    "split",
    "state_dict_of",
    "torch_dtype",
    "weights_view",
    "write_state",
]

# Parameter dtypes a learner may train in, and the code its gradients are pushed with.
PARAM_DTYPES = {torch.float32: _native.DTYPE_F32, torch.bfloat16: _native.DTYPE_BF16,
                torch.float16: _native.DTYPE_F16}
_BUFFER_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.bool)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a spec names (``float32``, ``bfloat16``, ``int64``, ...)."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise SpecError(f"the job's spec names an unknown dtype {name!r}")
    return dt


def model_spec(model: torch.nn.Module, order: Sequence[str] | None = None,
               ) -> tuple[list[ParamSpec], list[torch.Tensor], list[tuple[torch.nn.Module, str]]]:
    """The spec of ``model``'s state, its parameters in spec order, and where each spec buffer lives
    (module, attribute name), in spec order.

    The spec lists trainable parameters, then frozen ones, then buffers (grouped by dtype), each in the
    model's order, or in ``order``'s (tensor names, e.g. a job's, whose file listed them by name).

    Raises SpecError, saying what to do, for a model psd cannot hold: no trainable parameter, parameters
    on several devices or of several dtypes, or a dtype other than float32, bfloat16 and float16.
    """
    persistent = set(model.state_dict(keep_vars=True))
    train, frozen = [], []
    for name, p in model.named_parameters():
        if p.dtype not in PARAM_DTYPES:
            hint = ("psd keeps float32 master weights; call model.float() (or model.bfloat16()) before attaching"
                    if p.dtype.is_floating_point else "only floating-point parameters can be trained")
            raise SpecError(f"parameter {name!r} is {p.dtype}: {hint}")
        (train if p.requires_grad else frozen).append((name, p))
    if not train:
        raise SpecError("the model has no parameters to train (all are frozen or there are none)")
    rank = {n: i for i, n in enumerate(order or ())}
    if order is not None:
        train.sort(key=lambda x: rank.get(x[0], len(rank)))
        frozen.sort(key=lambda x: rank.get(x[0], len(rank)))
    first_name, first = train[0]
    for name, p in train + frozen:
        if p.device != first.device:
            raise SpecError(f"parameter {name!r} is on {p.device} but {first_name!r} on {first.device}; "
                            f"a psd learner's model lives on one device (model.to(device))")
        if p.dtype != first.dtype:
            raise SpecError(f"parameter {name!r} is {p.dtype} but {first_name!r} is {first.dtype}; a psd learner's "
                            f"parameters share one dtype (model.to({first.dtype}), or train in float32 with "
                            f"torch.autocast)")
    spec = [ParamSpec(n, tuple(p.shape), _dtype_name(p.dtype)) for n, p in train]
    spec += [ParamSpec(n, tuple(p.shape), _dtype_name(p.dtype), "frozen") for n, p in frozen]
    params = [p for _, p in train + frozen]
    bufs = []
    for name, b in model.named_buffers():
        if name not in persistent:
            continue  # not in the state_dict: not the job's
        if b.dtype not in _BUFFER_DTYPES:
            raise SpecError(f"buffer {name!r} is {b.dtype}; psd holds real and integer buffers only")
        owner, _, attr = name.rpartition(".")
        bufs.append((name, b, model.get_submodule(owner) if owner else model, attr))
    if order is not None:
        bufs.sort(key=lambda x: rank.get(x[0], len(rank)))
    dtype_order: dict[torch.dtype, int] = {}
    for _, b, _, _ in bufs:
        dtype_order.setdefault(b.dtype, len(dtype_order))
    # Grouped by dtype (model order within a group), the buffers entries set before the counters they add to.
    bufs.sort(key=lambda x: (_dtype_name(x[1].dtype) not in SET_BUFFER_DTYPES, dtype_order[x[1].dtype]))
    spec += [ParamSpec(n, tuple(b.shape), _dtype_name(b.dtype), "buffer") for n, b, _, _ in bufs]
    return spec, params, [(mod, attr) for _, _, mod, attr in bufs]


def split(flat: torch.Tensor, spec: Iterable[ParamSpec]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as the tensors of ``spec``, one after the other."""
    out, off = [], 0
    for p in spec:
        out.append(flat[off:off + p.numel].view(p.shape))
        off += p.numel
    return out


def buffer_groups(spec: Iterable[ParamSpec]) -> list[tuple[int, int, torch.dtype]]:
    """(start, end, dtype) of each run of same-dtype buffers in the arena's float64 buffer vector."""
    groups: list[tuple[int, int, torch.dtype]] = []
    off = 0
    for p in spec:
        if p.kind != "buffer":
            continue
        dt = torch_dtype(p.dtype)
        if groups and groups[-1][2] == dt:
            groups[-1] = (groups[-1][0], off + p.numel, dt)
        else:
            groups.append((off, off + p.numel, dt))
        off += p.numel
    return groups


def weights_view(arena: _native.Arena, h: Mapping) -> torch.Tensor:
    """The arena's float32 weights (trainable, then frozen), as a tensor over the mapping."""
    return torch.frombuffer(arena, dtype=torch.float32, count=h["n_params"], offset=h["weights_off"])


def buffers_view(arena: _native.Arena, h: Mapping) -> torch.Tensor:
    """The arena's float64 buffers, as a tensor over the mapping (empty for a model without buffers)."""
    if not h["n_buffers"]:
        return torch.empty(0, dtype=torch.float64)
    return torch.frombuffer(arena, dtype=torch.float64, count=h["n_buffers"], offset=h["buffers_off"])


def pieces_view(arena: _native.Arena, h: Mapping) -> torch.Tensor:
    """The update loop's per-tensor state, int64 (n_pieces, PIECE_WORDS): optimizer steps, bsp / kasync round
    mark, and under kasync with Adam the gradients the tensor took and how many of them in that round
    (native/psd_layout.h struct psd_piece)."""
    return torch.frombuffer(arena, dtype=torch.int64, count=_native.PIECE_WORDS * h["n_pieces"],
                            offset=h["pieces_off"]).view(h["n_pieces"], _native.PIECE_WORDS)


def in_model_dtypes(spec: list[ParamSpec], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state_dict of fresh tensors in each one's own dtype, from the arena's float32 / float64 values
    (integer buffers rounded to the nearest integer)."""
    out = {}
    for p in spec:
        dt, v = torch_dtype(p.dtype), tensors[p.name]
        out[p.name] = (v.round() if not dt.is_floating_point and dt != torch.bool else v).to(dt, copy=True)
    return out


def state_dict_of(spec: list[ParamSpec], weights: torch.Tensor, buffers: torch.Tensor) -> dict[str, torch.Tensor]:
    """A state_dict (fresh tensors in each tensor's own dtype) from flat float32 weights and float64 buffers."""
    tensors = [p for p in spec if p.kind != "buffer"]
    bufs = [p for p in spec if p.kind == "buffer"]
    views = dict(zip((p.name for p in tensors), split(weights, tensors), strict=True))
    views.update(zip((p.name for p in bufs), split(buffers, bufs), strict=True))
    return in_model_dtypes(spec, views)


def write_state(spec: list[ParamSpec], tensors: Mapping[str, torch.Tensor], weights: torch.Tensor,
                buffers: torch.Tensor) -> None:
    """Copy tensors by name into flat float32 weights and float64 buffers (an arena's, or a checkpoint's)."""
    params = [p for p in spec if p.kind != "buffer"]
    bufs = [p for p in spec if p.kind == "buffer"]
    for p, v in zip(params, split(weights, params), strict=True):
        v.copy_(tensors[p.name].reshape(p.shape))
    for p, v in zip(bufs, split(buffers, bufs), strict=True):
        v.copy_(tensors[p.name].reshape(p.shape))
