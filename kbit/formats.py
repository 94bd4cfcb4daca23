"""The storage format, in pure PyTorch: the ground truth every CUDA kernel is tested against.

Storage format (docs/DESIGN.md#storage-format; the README's "Format" section says the same for users):

* The input is flattened and cut into blocks of 32 consecutive elements (the last block is
  zero-padded).
* ``packed``: int32 tensor of shape ``[blocks * bits]``. Word ``i * bits + b`` is bit-plane ``b``
  of block ``i``: bit ``j`` of that word is bit ``b`` of the code of element ``32 * i + j``.
* ``absmax``: uint8 tensor of shape ``[blocks]``, the block's absolute maximum encoded as
  E4M4 (4 exponent bits, bias 11, 4 mantissa bits, subnormals when the exponent field is 0).
* ``codebook``: float32 tensor of ``2**bits`` values, sorted ascending, reconstruction levels in
  units of the block absmax.
* ``scale``: a per-tensor power-of-two factor (float32, default 1.0). It is our remedy for
  absmax values outside E4M4's range [2**-14, 31]: elements are divided by ``scale`` before
  their block absmax is encoded, and dequantization multiplies it back. Power-of-two scales
  make both steps exact.
* ``meta``: int64 ``[bits, out_features, in_features, dtype code]`` of a saved [out_features,
  in_features] weight (``META_FIELDS``, ``DTYPE_CODES``).

A weight [out_features, in_features] is stored as the matrix zero-padded to ``padded_in_features``
columns and flattened, so that no block crosses a row (``storage_spec``).

Element ``x`` of block ``i`` is reconstructed as
``codebook[code] * (decode_absmax_e4m4(absmax[i]) * scale)``, computed in float32, then
rounded to the output dtype. The code of ``x`` is the index of the codebook entry nearest to
``v = (x * (1 / scale)) * (1 / decoded_absmax)`` (float32, each step rounded; ``v = 0`` for a
block whose absmax decodes to 0), found by counting the midpoints
``(codebook[i] + codebook[i + 1]) / 2`` that lie strictly below ``v`` (ties go to the lower
entry). These exact float32 steps are what the CUDA kernel computes too, so both agree bit for
bit.
"""

from __future__ import annotations

import functools
import math

import torch

BLOCK_SIZE = 32
SUPPORTED_BITS = (2, 3, 4, 5)
E4M4_BIAS = 11
E4M4_MAX = 31.0  # exponent field 15, mantissa 15: 2**4 * 31/16
E4M4_MIN_SUBNORMAL = 2.0**-14  # exponent field 0, mantissa 1: 2**(1 - 11) / 16

# What a saved weight holds: the keys of QuantizedWeight.state_dict() / KbitLinear's persistent buffers.
STATE_KEYS = ("packed", "absmax", "codebook", "scale", "meta")
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
# ``meta`` of one weight, and of a mixture-of-experts layer (kbit.moe: every expert has the same shapes).
META_FIELDS = ("bits", "out_features", "in_features", "dtype code")
EXPERTS_META_FIELDS = ("bits", "num_experts", "hidden_dim", "intermediate_dim", "dtype code")


def block_count(n: int) -> int:
    """Blocks of ``BLOCK_SIZE`` that hold ``n`` elements (the last one zero-padded)."""
    return (n + BLOCK_SIZE - 1) // BLOCK_SIZE


def padded_in_features(in_features: int) -> int:
    """Columns of a stored weight: in_features rounded up to a multiple of 32 (rows are zero-padded)."""
    return block_count(in_features) * BLOCK_SIZE


def storage_spec(key: str, bits: int, shape) -> tuple:
    """(dtype, shape) of storage tensor ``key`` of a ``bits``-bit [out_features, in_features] weight; of E such
    weights for a shape [E, out_features, in_features] (``packed``, ``absmax`` and ``scale`` then have a leading E,
    one weight's per row; the codebook is shared)."""
    *experts, out_features, in_features = shape
    blocks = block_count(out_features * padded_in_features(in_features))
    return {"packed": (torch.int32, (*experts, blocks * bits)), "absmax": (torch.uint8, (*experts, blocks)),
            "codebook": (torch.float32, (2**bits,)), "scale": (torch.float32, tuple(experts)),
            "meta": (torch.int64, (len(META_FIELDS),))}[key]


def meta_tensor(bits: int, shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The ``meta`` entry of a saved [out_features, in_features] weight quantized from ``dtype``."""
    return torch.tensor([bits, shape[0], shape[1], DTYPE_CODES[dtype]], dtype=torch.int64, device=device)


def experts_meta_tensor(bits: int, num_experts: int, hidden_dim: int, intermediate_dim: int, dtype: torch.dtype,
                        device=None) -> torch.Tensor:
    """The ``meta`` entry of a mixture-of-experts layer (``EXPERTS_META_FIELDS``)."""
    values = [bits, num_experts, hidden_dim, intermediate_dim, DTYPE_CODES[dtype]]
    return torch.tensor(values, dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------- codebook
@functools.lru_cache(maxsize=None)
def _normal_float_codebook_cpu(bits: int) -> torch.Tensor:
    # Expected value of N(0, 1) inside each of 2**bits equiprobable bins:
    # E[X | a < X < b] = (phi(a) - phi(b)) / (Phi(b) - Phi(a)) = (phi(a) - phi(b)) * 2**bits.
    n = 2**bits
    # On the CPU explicitly: the first call may come inside a torch.device("meta") context (transformers builds
    # empty models in one), and a meta codebook would then be cached for good.
    p = torch.arange(n + 1, dtype=torch.float64, device="cpu") / n
    edges = torch.special.ndtri(p)  # -inf ... +inf
    pdf = torch.exp(-0.5 * edges * edges) / math.sqrt(2.0 * math.pi)
    pdf = torch.where(torch.isfinite(edges), pdf, torch.zeros_like(pdf))
    means = (pdf[:-1] - pdf[1:]) * n
    # Rounded to fp16 (at most 2^-12 from the exact levels; +-1 stay exact): the fused kernel's lookup tables hold
    # the levels in the activations' 16-bit type, and an fp16 table that is not the stored codebook shifts every
    # weight of a code by the same relative error, a systematic error that at K = 3 made the fp16 GEMM's error up
    # to 2x that of dequantize + cuBLAS. With fp16-exact levels the fp16 kernel multiplies by the stored weights.
    cb = (means / means.abs().max()).to(torch.float16).to(torch.float32)
    return cb


def create_normal_float_codebook(bits: int = 4, device=None) -> torch.Tensor:
    """The normal-float codebook: 2**bits sorted levels, max |value| == 1 (cached per bit width)."""
    cb = _normal_float_codebook_cpu(bits)
    return cb.to(device=device, copy=True) if device is not None else cb.clone()  # never the cached tensor


# ----------------------------------------------------------------------------- E4M4
def encode_absmax_e4m4(x: torch.Tensor) -> torch.Tensor:
    """Encode non-negative, finite values as E4M4 uint8, round-to-nearest-even, saturating at 31.

    Integer arithmetic on the float32 bit pattern, so the CUDA encoder can match it exactly.
    """
    x = x.to(torch.float32)
    bits = x.view(torch.int32).to(torch.int64)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    # Normal path: keep 4 mantissa bits, round the remaining 19 half-to-even.
    m4 = man >> 19
    rem = man & 0x7FFFF
    round_up = (rem > 0x40000) | ((rem == 0x40000) & ((m4 & 1) == 1))
    m4 = m4 + round_up.to(torch.int64)
    e = exp - 127 + E4M4_BIAS + (m4 >> 4)  # mantissa carry bumps the exponent
    m4 = m4 & 0xF
    normal = (e << 4) | m4
    normal = torch.where(e > 15, torch.full_like(normal, 0xFF), normal)
    # Subnormal path (value < 2**-10): code = round(x / 2**-14); 16 rounds up to 0x10 == 2**-10.
    sub = torch.round(x.to(torch.float64) * 2.0**14).to(torch.int64)
    code = torch.where(exp - 127 < -10, sub, normal)
    return code.to(torch.uint8)


def decode_absmax_e4m4(code: torch.Tensor) -> torch.Tensor:
    """Decode E4M4 uint8 codes to float32 (exact)."""
    c = code.to(torch.int32)
    e = c >> 4
    m = (c & 0xF).to(torch.float32)
    normal = torch.ldexp(1.0 + m / 16.0, (e - E4M4_BIAS).to(torch.float32))
    sub = m * 2.0**-14
    return torch.where(e == 0, sub, normal).to(torch.float32)


def choose_tensor_scale(block_absmax_max: torch.Tensor) -> torch.Tensor:
    """Per-tensor power-of-two scale that puts the largest block absmax into (8, 16].

    Leaves E4M4 headroom above (up to 31) and 2**17 of dynamic range below for smaller blocks.
    Returns a 0-dim float32 tensor on the input's device; 1.0 for an all-zero tensor.
    """
    m = block_absmax_max.to(torch.float32)
    e = torch.ceil(torch.log2(torch.clamp(m, min=torch.finfo(torch.float32).tiny))) - 4
    # Keep the scale a normal float32 (>= 2**-126) so that 1 / scale stays finite: for tensors
    # smaller than ~2**-122 this leaves their absmax below 16 after scaling, still in range.
    e = torch.clamp(e, min=-126.0)
    return torch.where(m > 0, torch.exp2(e), torch.ones_like(m)).reshape(())


# ----------------------------------------------------------------------------- bit planes
def to_int32_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same bit pattern."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_bitplanes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: integer [blocks, 32] in [0, 2**bits) -> int32 [blocks * bits] bit-plane words."""
    shifts = torch.arange(BLOCK_SIZE, device=codes.device, dtype=torch.int64)
    c = codes.to(torch.int64)
    planes = [(((c >> b) & 1) << shifts).sum(dim=1) for b in range(bits)]
    return to_int32_bits(torch.stack(planes, dim=1)).reshape(-1)


def unpack_bitplanes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [blocks * bits] -> int64 codes [blocks, 32]."""
    words = packed.reshape(-1, bits).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(BLOCK_SIZE, device=packed.device, dtype=torch.int64)
    planes = (words[:, :, None] >> shifts) & 1  # [blocks, bits, 32]
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int64))[None, :, None]
    return (planes * weights).sum(dim=1)


# ----------------------------------------------------------------------------- reference quantize / dequantize
def nearest_codes(x: torch.Tensor, decoded_absmax: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Codes of blocks ``x`` [nb, 32] (float32, already divided by the tensor scale) for their decoded absmax.

    ``v = x * (1 / d)`` (0 where d == 0), then the number of codebook midpoints strictly below ``v``.
    """
    recip = torch.where(decoded_absmax > 0, 1.0 / torch.where(decoded_absmax > 0, decoded_absmax, 1.0), 0.0)
    v = x * recip[:, None]
    cb = codebook.to(device=x.device, dtype=torch.float32)
    mids = (cb[1:] + cb[:-1]) * 0.5
    return torch.bucketize(v, mids, right=False)


def blocks_of(A: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A flattened, divided by ``scale`` in float32, zero-padded and cut into blocks: [nb, 32]."""
    x = A.reshape(-1).to(torch.float32) * (1.0 / scale.to(device=A.device, dtype=torch.float32))
    n = x.numel()
    return torch.nn.functional.pad(x, (0, block_count(n) * BLOCK_SIZE - n)).reshape(-1, BLOCK_SIZE)


def quantize_reference(A: torch.Tensor, codebook: torch.Tensor, bits: int, scale: torch.Tensor):
    """Reference implementation of the quantize op (no validation). Returns (packed, absmax)."""
    x = blocks_of(A, scale)
    if x.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int32, device=A.device), torch.zeros(0, dtype=torch.uint8, device=A.device)
    absmax = encode_absmax_e4m4(x.abs().amax(dim=1))
    return pack_bitplanes(nearest_codes(x, decode_absmax_e4m4(absmax), codebook), bits), absmax


def dequantize_reference(packed, absmax, codebook, bits: int, n: int, dtype, scale: torch.Tensor):
    """Reference implementation of the dequantize op (no validation). Returns a flat tensor of n."""
    codes = unpack_bitplanes(packed, bits)
    block_scale = decode_absmax_e4m4(absmax) * scale.to(device=absmax.device, dtype=torch.float32).reshape(())
    cb = codebook.to(device=packed.device, dtype=torch.float32)
    vals = cb[codes] * block_scale[:, None]
    return vals.reshape(-1)[:n].to(dtype)
