"""The lazy GDN state's bookkeeping can be captured in a CUDA graph.

vLLM captures the GDN layer of a uniform spec-decode batch in a FULL CUDA graph, so everything
`LazyGdnState.verify` does must be device work.  Assigning a Python scalar to a CUDA tensor
(``lazy[idx] = True``, ``lazy[-1] = False``) first makes a host tensor of it and copies that to the
device, which capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA graph
capture"); seen on the H200 when vLLM's CUDAGraphWrapper captured LazyQwenGDN
(tests/gpu/test_layers_gpu.py, which now runs it in graphs).  On CPU the same writes show up as a
0-dim value tensor handed to index_put_ / copy_: this test records the aten calls that write the
bookkeeping tensors (flags, halves, parity) during verify, commit and forget steps and refuses any
such write.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend.plugin.gdn_lazy import LazyGdnState
from kernels.gdn_verify.reference import TorchGdnKernels

pytestmark = pytest.mark.unit

H, HV, K, V, T, SLOTS = 1, 2, 16, 8, 4, 12


class HostScalarWrites(TorchDispatchMode):
    """Records writes into `watched` storages whose value is a 0-dim tensor (a lifted host scalar)."""

    def __init__(self, watched: list[torch.Tensor]) -> None:
        super().__init__()
        self.watched = {t.untyped_storage().data_ptr() for t in watched}
        self.bad: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is not None and target.untyped_storage().data_ptr() in self.watched:
            name = func.overloadpacket.__name__
            if name in ("index_put_", "_index_put_impl_"):
                values = args[2] if len(args) > 2 else kwargs.get("values")
                if isinstance(values, torch.Tensor) and values.dim() == 0:
                    self.bad.append(f"{func} with a host scalar")
            elif name == "copy_" and isinstance(args[1], torch.Tensor) and args[1].dim() == 0:
                self.bad.append(f"{func} from a host scalar")
            elif name == "fill_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
                self.bad.append(f"{func} from a tensor value")
        return func(*args, **kwargs)


def _state(seed: int) -> tuple[LazyGdnState, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(SLOTS, HV, V, K, generator=g) * 0.1
    st = LazyGdnState(pool, num_k_heads=H, max_tokens=T, log_dtype=torch.float32, state_vk=True,
                      kernels=TorchGdnKernels)
    return st, g


def _verify(st: LazyGdnState, g: torch.Generator, windows: torch.Tensor, acc: list[int]) -> None:
    B = windows.shape[0]
    q, k = (torch.randn(B, T, H, K, generator=g) for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=g)
    a, b = (torch.randn(B, T, HV, generator=g) for _ in range(2))
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV)
    st.verify(q, k, v, a, b, A_log, dt_bias, windows, torch.tensor(acc, dtype=torch.int32))


def test_verify_commit_and_forget_write_no_host_scalars() -> None:
    st, g = _state(1)
    windows = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [-1, -1, -1, -1]], dtype=torch.int32)  # a padded row
    with HostScalarWrites([st.lazy, st.half, st.parity]) as mode:
        _verify(st, g, windows, [1, 1, 1])
        _verify(st, g, windows, [3, 4, 1])  # replays the previous step's accepted tokens
        st.commit_rows(windows, torch.tensor([2, 1, 1], dtype=torch.int32), torch.zeros(HV), torch.zeros(HV))
        st.forget(torch.tensor([4], dtype=torch.int32))
    assert mode.bad == []
    assert st.lazy.tolist()[:8] == [False] * 8 and not st.lazy[-1]  # committed, forgotten, spare clear


def test_the_recorder_sees_the_writes_capture_refuses() -> None:
    """The form the plugin had before (a scalar through an index, a scalar into one element)."""
    st, _ = _state(2)
    with HostScalarWrites([st.lazy]) as mode:
        st.lazy[torch.tensor([1, 3])] = True
        st.lazy[-1] = False
    assert len(mode.bad) >= 1, mode.bad
