"""cuBLASLt called directly (ctypes): every algorithm cuBLASLt's heuristic offers for one GEMM,
so that they can be timed against the one PyTorch takes.

PyTorch asks cuBLASLt's heuristic for one algorithm per GEMM and runs it. With that choice the
GEMMs of a B=16 Qwen-Image block need not all run at the card's matmul rate (the MLP's
GELU-epilogue GEMM and the attention projections can trail the MLP's down projection), and the
heuristic's first answer need not be its best. The heuristic returns several candidates per
shape; this module lists them (`Gemm.candidates`) and runs any of them (`Gemm.run`) on PyTorch's
current stream, with PyTorch tensors as operands.

Row-major y (M, N) = x (M, K) W^T (N, K) is the column-major product y^T = W x^T, so A is W
(transposed), B is x and C/D are y, with each operand's row stride as its leading dimension (row
slices of a larger buffer work). Epilogues: none, bias, bias + tanh GELU (`Gemm.EPILOGUES`); with
`accumulate` the product is added to what `out` holds (beta = 1).

The shared library is the one PyTorch loaded (found in the process's memory map after a cuBLASLt
call), so its version is PyTorch's. CUDA only; nothing is loaded on import.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_COMPUTE_32F = 68
_SCALE_32F = 0
_DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2, torch.float32: 0}
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_PREF_MAX_WORKSPACE_BYTES = 1
# name: (cublasLtMatmulAlgoConfigAttributes_t, size in bytes: the call wants the exact size)
_CONFIG_ATTRIBUTES = {
    "id": (0, 4),
    "tile": (1, 4),
    "splitk": (2, 4),
    "reduction": (3, 4),
    "swizzle": (4, 4),
    "custom": (5, 4),
    "stages": (6, 4),
    "inner": (7, 2),
    "cluster": (8, 2),
}

WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@functools.cache
def _library() -> ctypes.CDLL:
    """The libcublasLt PyTorch uses: one GELU-epilogue GEMM makes PyTorch load it, then its path is
    read from /proc/self/maps."""
    x = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    torch._addmm_activation(x[0], x, x, use_gelu=True)
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
    if not paths:
        raise RuntimeError("PyTorch did not load libcublasLt; direct cuBLASLt calls need a CUDA build of PyTorch")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.cublasLtMatmul.argtypes = [ctypes.c_void_p] * 12 + [
        ctypes.POINTER(_Algo),
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
    ]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [ctypes.c_void_p] * 7 + [
        ctypes.c_int,
        ctypes.POINTER(_HeuristicResult),
        ctypes.POINTER(ctypes.c_int),
    ]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [
        ctypes.POINTER(_Algo),
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_size_t),
    ]
    return lib


@functools.cache
def _handle(device_index: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _workspace(device_index: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", device_index))


def describe(algo: _Algo) -> dict[str, int]:
    """The algorithm's configuration numbers (algorithm id, tile, split-K, stages, cluster, ...)."""
    lib, out = _library(), {}
    for name, (attribute, size) in _CONFIG_ATTRIBUTES.items():
        value, written = ctypes.c_uint64(0), ctypes.c_size_t(0)  # little-endian: the low bytes are the value
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(
            ctypes.byref(algo), attribute, ctypes.byref(value), size, ctypes.byref(written)
        )
        if status == 0:
            out[name] = value.value
    return out


class Gemm:
    """One GEMM problem: out (M, N) [+]= x (M, K) @ weight (N, K)^T [+ bias] [then tanh GELU], with
    the operands' row strides fixed (`x_stride`, `out_stride`: the leading dimensions)."""

    EPILOGUES = {"none": 1, "bias": 4, "gelu_bias": 36}

    def __init__(
        self,
        m: int,
        n: int,
        k: int,
        dtype: torch.dtype,
        epilogue: str = "bias",
        accumulate: bool = False,
        x_stride: int | None = None,
        out_stride: int | None = None,
        device_index: int | None = None,
    ):
        if epilogue not in self.EPILOGUES:
            raise ValueError(f"Gemm: epilogue={epilogue!r} is not one of {sorted(self.EPILOGUES)}")
        if dtype not in _DATA_TYPES:
            raise ValueError(f"Gemm: dtype={dtype} is not one of {sorted(map(str, _DATA_TYPES))}")
        self.m, self.n, self.k, self.epilogue, self.accumulate = m, n, k, epilogue, accumulate
        self.device_index = torch.cuda.current_device() if device_index is None else device_index
        lib, data_type = _library(), _DATA_TYPES[dtype]
        self._desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _SCALE_32F), "MatmulDescCreate")
        for attribute, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            self._set(attribute, ctypes.c_int32(value))
        self._set(_DESC_EPILOGUE, ctypes.c_uint32(self.EPILOGUES[epilogue]))
        self._a = self._layout(data_type, k, n, k)
        self._b = self._layout(data_type, k, m, x_stride or k)
        self._c = self._layout(data_type, n, m, out_stride or n)
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if accumulate else 0.0)

    def _set(self, attribute: int, value) -> None:
        _check(
            _library().cublasLtMatmulDescSetAttribute(self._desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
            f"MatmulDescSetAttribute({attribute})",
        )

    @staticmethod
    def _layout(data_type: int, rows: int, cols: int, leading: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(
            _library().cublasLtMatrixLayoutCreate(
                ctypes.byref(layout), data_type, ctypes.c_uint64(rows), ctypes.c_uint64(cols), ctypes.c_int64(leading)
            ),
            "MatrixLayoutCreate",
        )
        return layout

    def candidates(self, bias: torch.Tensor | None = None, limit: int = 32) -> list[_HeuristicResult]:
        """The heuristic's algorithms for this problem, best guess first (the first is PyTorch's
        choice when PyTorch asks with the same workspace); `bias` only sets the alignment the
        heuristic assumes for it."""
        lib = _library()
        if bias is not None:
            self._set(_DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        preference = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "MatmulPreferenceCreate")
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(
                preference, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), ctypes.c_size_t(8)
            ),
            "MatmulPreferenceSetAttribute",
        )
        results, count = (_HeuristicResult * limit)(), ctypes.c_int(0)
        try:
            _check(
                lib.cublasLtMatmulAlgoGetHeuristic(
                    _handle(self.device_index),
                    self._desc,
                    self._a,
                    self._b,
                    self._c,
                    self._c,
                    preference,
                    limit,
                    results,
                    ctypes.byref(count),
                ),
                "MatmulAlgoGetHeuristic",
            )
        finally:
            lib.cublasLtMatmulPreferenceDestroy(preference)
        return [results[i] for i in range(count.value) if results[i].state == 0]

    def run(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor,
        algo: _HeuristicResult,
    ) -> torch.Tensor:
        """out [+]= epilogue(x @ weight^T + bias) with `algo`, on the current stream."""
        if self.epilogue != "none":
            self._set(_DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        stream = torch.cuda.current_stream(self.device_index).cuda_stream
        workspace = _workspace(self.device_index)
        _check(
            _library().cublasLtMatmul(
                _handle(self.device_index),
                self._desc,
                ctypes.byref(self._alpha),
                weight.data_ptr(),
                self._a,
                x.data_ptr(),
                self._b,
                ctypes.byref(self._beta),
                out.data_ptr(),
                self._c,
                out.data_ptr(),
                self._c,
                ctypes.byref(algo.algo),
                workspace.data_ptr(),
                algo.workspace_size,
                stream,
            ),
            "Matmul",
        )
        return out
