"""A learner's private memory laid out over the job's spec: the two float32 weight buffers and their views,
the trainable tensors' geometry, and the model's buffers gathered into one tensor per dtype (what a push
sends of them, what a pull takes).

``Layout`` is the part of :class:`psd.learner.Learner` that does it.
"""

from __future__ import annotations

import struct

import torch

from psd.arena import ParamSpec, buffers_set, model_sizes, piece_geometry
from psd.errors import SpecError
from psd.state import PARAM_DTYPES, buffer_groups, split, torch_dtype

__all__ = ["Layout"]


def _sparse_tensors(model: torch.nn.Module, train: list[torch.Tensor]) -> list[int]:
    """Indices (among the trainable tensors) of embedding tables that get sparse gradients."""
    sparse = {id(m.weight) for m in model.modules()
              if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse}
    return [k for k, p in enumerate(train) if id(p) in sparse]


def _runs_by_device(members: list[tuple[ParamSpec, tuple[torch.nn.Module, str]]]) -> list[list]:
    """``members`` (spec, (module, attribute)) split into runs of consecutive buffers on one device."""
    runs: list[list] = []
    for m in members:
        mod, attr = m[1]
        if runs and getattr(runs[-1][0][1][0], runs[-1][0][1][1]).device == getattr(mod, attr).device:
            runs[-1].append(m)
        else:
            runs.append([m])
    return runs


class Layout:
    """The learner's private buffers and its model's buffers. A part of
    :class:`psd.learner.Learner` (one of its base classes); what it reads and writes lives on the learner."""

    def _layout(self, state: tuple) -> None:
        """Lay out the private buffers for the model's state in spec order (``model_spec``'s result)."""
        spec, params, owners = state
        self._spec, self._params = spec, params  # params: the trainable ones, then the frozen ones
        self.n_params, self.n_train, self.n_buffers, self.n_pieces = model_sizes(spec)
        n = self.n_params
        self._train = params[:self.n_pieces]
        self._numels = tuple(p.numel for p in spec[:self.n_pieces])
        geometry = piece_geometry(spec)
        self._row_lens = tuple(r for _, r in geometry)
        offs = [0]
        for length, _ in geometry:
            offs.append(offs[-1] + length)
        # The job's trainable tensors as (off, len, row_len), for pulls of the rows that changed.
        self._piece_table = struct.pack(f"<{3 * len(geometry)}Q", *[v for k, (length, r) in enumerate(geometry)
                                                                    for v in (offs[k], length, r)])
        self.dtype = params[0].dtype
        self._dtype_code = PARAM_DTYPES[self.dtype]
        self._sparse = _sparse_tensors(self.model, self._train)
        # A model with sparse gradients pulls only the rows and tensors the updates since its last pull
        # changed (the server's rows log), not the whole table (copy pulls, inline).
        self._rows_pull = bool(self._sparse) and self.pull_mode == "copy" and self._plain()
        self._log_pos = self._epoch = 0
        self.pulled_bytes = 0
        self._wspec = wspec = [p for p in spec if p.kind != "buffer"]
        # The ranges of the weights this learner copies in (all of them, unless a partial attach holds some).
        self._own: list[tuple[int, int, bool]] = []  # (offset, length, frozen)
        off = 0
        for i, p in enumerate(wspec):
            if self._present is None or self._present[i]:
                self._own.append((off, p.numel, p.kind == "frozen"))
            off += p.numel
        # Two private float32 weight buffers: the model trains on the front one; the pull thread fills
        # the other. A bfloat16 / float16 model trains on its own copy of the front, in its dtype.
        self._bufs = [torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)]
        self._buf_views = [split(b, wspec) for b in self._bufs]
        self._lowp = None if self.dtype == torch.float32 else torch.empty(n, dtype=self.dtype)
        if self.pull_mode == "view" and (self._lowp is not None or self.device.type != "cpu"):
            raise SpecError(f"{self._pull_source} makes the parameters views of the job's float32 weights in "
                            f"shared memory, so it needs a float32 model on the CPU (this one is {self.dtype} on "
                            f"{self.device}): pull a copy instead (pull='copy', PSD_PULL=copy, psd run --pull copy)")
        self._front = 0
        self._adopt_buffers(spec, owners)

    def _own_runs(self, frozen: bool = True) -> list[tuple[int, int, int]]:
        """This learner's weights (``_own``: the trainable ones, and the frozen ones with ``frozen``) packed one
        after another in the job's order, as (offset in the job's weights, offset packed, length), consecutive
        ranges merged: one run for a whole model. The trainable ones come first (the job's weights begin with
        them), so the trainable runs of a packed buffer are also those of its gradients. A learner on a GPU
        keeps its weights and gradients packed so (learner/device.py)."""
        runs: list[tuple[int, int, int]] = []
        packed = 0
        for off, length, is_frozen in self._own:
            if is_frozen and not frozen:
                continue
            if runs and runs[-1][0] + runs[-1][2] == off:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + length)
            else:
                runs.append((off, packed, length))
            packed += length
        return runs

    def _adopt_buffers(self, spec: list[ParamSpec], owners: list[tuple[torch.nn.Module, str]]) -> None:
        """Make the model's buffers views of one private tensor per dtype, so that pushing how far they
        moved and taking the job's merged values are one copy per dtype, not one per buffer."""
        self._bgroups = []
        self._bcur = torch.empty(self.n_buffers, dtype=torch.float64)  # this learner's values now
        self._bbase = torch.empty(self.n_buffers, dtype=torch.float64)  # ... when it last pulled them
        self._bdelta = torch.empty(self.n_buffers, dtype=torch.float64)  # what is pushed
        self._bset = buffers_set(spec)
        specs = [p for p in spec if p.kind == "buffer"]
        i = 0
        for lo, _, dt in buffer_groups(spec):  # the spec lists buffers grouped by dtype
            members = []
            while i < len(specs) and torch_dtype(specs[i].dtype) == dt:
                members.append((specs[i], owners[i]))
                i += 1
            # One tensor per run of them on one device: all of them on a CPU learner; a partial learner on a
            # GPU has its own buffers there and the stand-ins for the other stages' on the CPU.
            for run in _runs_by_device(members):
                flat = torch.cat([getattr(mod, attr).detach().reshape(-1) for _, (mod, attr) in run]).to(dt)
                for (_, (mod, attr)), v in zip(run, split(flat, [p for p, _ in run]), strict=True):
                    setattr(mod, attr, v)
                self._bgroups.append((lo, lo + flat.numel(), flat))
                lo += flat.numel()
        self._bbase.copy_(self._buffers_now())

    def _buffers_now(self) -> torch.Tensor:
        """This learner's buffer values, as float64 (into its own tensor)."""
        for lo, hi, flat in self._bgroups:
            self._bcur[lo:hi].copy_(flat)
        return self._bcur

    def _buffer_delta(self) -> int | None:
        """The address of this learner's buffers as pushed (None: no buffers): the values of the
        real-valued ones (they become the job's), then how far the counters moved since they were
        last pulled (the job adds that, so counters count every learner's batches)."""
        if not self.n_buffers or (self.partial and self._buf_range is None):  # a stage without buffers
            return None
        torch.sub(self._buffers_now(), self._bbase, out=self._bdelta)
        self._bdelta[:self._bset].copy_(self._bcur[:self._bset])
        if self.partial:  # the other stages' values are not pushed (a non-finite one would flag the entry)
            lo, hi = self._buf_range
            self._bdelta[:lo] = 0.0
            self._bdelta[hi:self._bset] = 0.0
        self._bbase.copy_(self._bcur)
        return self._bdelta.data_ptr()

    def _pull_buffers(self) -> None:
        """Take the job's merged buffers into the model (with the weights that came with them)."""
        if not self.n_buffers:
            return
        self._bbase.copy_(self._arena_buffers)
        for lo, hi, flat in self._bgroups:
            flat.copy_(self._bbase[lo:hi])
