"""The GEMM layout: what ``repack_for_gemm`` makes of the storage format, in pure PyTorch.

docs/DESIGN.md#gemm-layout describes it; docs/DESIGN.md#pipeline how the kernels read it.

The fused kernel computes ``C^T = W @ X^T`` with ``mma.m16n8k16``: 16 weight rows (output
features) are the MMA's A operand, 8 tokens its B operand. To make the inner loop cheap, every
lane's codes arrive in its registers already in MMA-fragment order, so no bit is moved in the hot
loop except to extract a pair of codes, which indexes a table of dequantized ``half2`` pairs.

Reduction order. Inside each quantization block of 32 columns, lane ``l = 4*g + q`` of a warp
owns the columns of the MMA's A fragment in its natural k order: pair ``p`` (``p`` in 0..3) is
columns ``8p + 2q, 8p + 2q + 1`` of rows ``g`` and ``g + 8``, i.e. k slots ``2q, 2q+1`` (p = 0) and
``2q+8, 2q+9`` (p = 1) of k-step 0 and the same of k-step 1 (p = 2, 3). So the same registers
feed ``mma.sync`` and ``wgmma``. A lane's pairs of a block are ordered ``(p, r)``: pair ``p`` of
row ``g``, then pair ``p`` of row ``g + 8``, as the MMA's A registers take them (row ``g`` k-lo,
row ``g + 8`` k-lo, row ``g`` k-hi, row ``g + 8`` k-hi), so one 64-bit lookup of two pairs (2 bits)
fills two A registers side by side.

Exact memory shapes (``k`` = bits, ``N`` = out_features, ``K_pad`` = in_features padded to 32,
``N_pad = ceil(N / 256) * 256``, ``KG = ceil(K_pad / 256)``):

``B_gemm``: int32 ``[N_pad / 256, KG, 16, k, 32, 4]`` — indexed ``[block, kgroup, i, vec, lane, word]``,
    tile ``tile = 16*block + i``. For weight rows ``16*tile .. 16*tile + 15`` and columns ``256*kgroup .. 256*kgroup + 255``,
    lane ``l = 4*g + q`` owns a string of ``128 * k`` bits held in ``k`` 16-byte vectors
    (bit ``o`` of the string is bit ``o % 32`` of word ``(o % 128) // 32`` of vec ``o // 128``).
    The code of row ``16*tile + g + 8*r``, column ``256*kgroup + 32*t + 8*p + 2*q + e``
    (``t`` in 0..7 = block within the group, ``r`` in 0..1, ``p`` in 0..3, ``e`` in 0..1) is bits
    ``e*k .. e*k + k - 1`` of the ``2k``-bit index of pair number ``P = 8*t + 2*p + r``, the index the
    kernel looks up (code ``e = 0`` in its low bits). Bit ``n`` of pair ``P``'s index sits at string bit
    ``pair_bit_offsets(k)[P, n]``:
      k = 2, 4, 5: ``2*k*P + n`` (the pairs back to back). For k = 4 each pair is one byte, for k = 2
        each byte is pair ``p`` of both rows.
      k = 3: pairs ``P = 16*u + 4*s + i`` (two blocks per 3 words ``3u .. 3u + 2``): for ``s`` < 3 bits
        0..5 of byte ``i`` of word ``3u + s``; for ``s`` = 3 bits 6..7 of byte ``i`` of the three words
        (index bits ``2v, 2v + 1`` in word ``3u + v``). So every pair's index is one byte's low 6 bits or
        gathered from three bytes' top 2 bits at once (shifts and bit selects on whole words), and the
        kernel can address a 256-byte table row per byte with one PRMT, as at k = 4.
``absmax_gemm``: uint8 ``[N_pad / 256, KG, 16, 2, 8, 8]`` — indexed ``[block, kgroup, i, r, g, t]``: the
    E4M4 code of row ``16*tile + g + 8*r``, block ``8*kgroup + t``, ``tile = 16*block + i``.

The 16-row tiles of a block of 256 rows sit next to each other per k-group, so what one CTA tile (128 or 256
rows, aligned) needs of one k-group is one contiguous piece of each tensor: one copy each.

Rows past N and columns past K_pad are padding: code 0 and absmax 0 (so they dequantize to 0).
``unrepack_reference`` drops them and returns the storage format bit for bit.

The GEMM reads activations in 16-byte pieces: the CUDA binding pads x's columns to a multiple of
``X_ALIGN`` (its zero columns meet the weights' padding columns).
"""

from __future__ import annotations

import torch

from .formats import BLOCK_SIZE, pack_bitplanes, to_int32_bits, unpack_bitplanes

TILE_ROWS = 16  # weight rows per warp tile (the MMA's M)
N_ALIGN = 256  # rows of the largest CTA tile (docs/DESIGN.md#configurations): N is padded to this
BLOCK_TILES = N_ALIGN // TILE_ROWS  # 16-row tiles per block of the layout (contiguous per k-group)
K_GROUP = 256  # columns per pipeline step: 8 quantization blocks
LANES = 32
X_ALIGN = 8  # activation columns per 16-byte read of the GEMM
PAIRS = 64  # code pairs per lane and k-group: 8 blocks x 8


def pair_bit_offsets(bits: int) -> torch.Tensor:
    """[PAIRS, 2 * bits] int64: the string bit that holds bit n of pair P's table index (module docstring)."""
    P = torch.arange(PAIRS, dtype=torch.int64)[:, None]
    n = torch.arange(2 * bits, dtype=torch.int64)[None, :]
    if bits != 3:
        return 2 * bits * P + n
    u, s, i = P // 16, P // 4 % 4, P % 4
    in_byte = 96 * u + 32 * s + 8 * i + n
    gathered = 96 * u + 32 * (n // 2) + 8 * i + 6 + n % 2
    return torch.where(s < 3, in_byte, gathered)


def row_blocks(out_features: int) -> int:
    """Blocks of 256 rows (``N_ALIGN``) of the layout: also the length of a scale per 256 rows (``kbit::gemm`` of
    fused projections, each padded to whole blocks)."""
    return -(-out_features // N_ALIGN)


def gemm_shapes(bits: int, out_features: int, in_features_padded: int):
    """Shapes of (B_gemm, absmax_gemm) for an [out_features, in_features_padded] weight."""
    blocks = row_blocks(out_features)
    k_groups = -(-in_features_padded // K_GROUP)
    return (blocks, k_groups, BLOCK_TILES, bits, LANES, 4), (blocks, k_groups, BLOCK_TILES, 2, 8, 8)


def repack_reference(packed: torch.Tensor, absmax: torch.Tensor, bits: int, out_features: int,
                     in_features_padded: int):
    """Storage format -> (B_gemm, absmax_gemm). Pure permutation plus zero padding."""
    N, K = out_features, in_features_padded
    b_shape, a_shape = gemm_shapes(bits, N, K)
    nb, kg = b_shape[0], b_shape[1]
    nt = nb * BLOCK_TILES
    codes = unpack_bitplanes(packed, bits).reshape(N, K)
    codes = torch.nn.functional.pad(codes, (0, kg * K_GROUP - K, 0, nt * TILE_ROWS - N))
    # rows = 16*T + 8*r + g ; cols = 256*j + 32*t + 8*p + 2*q + e ; bit string order (t, p, r, e)
    c = codes.reshape(nt, 2, 8, kg, 8, 4, 4, 2).permute(0, 3, 2, 6, 4, 5, 1, 7)  # T j g q t p r e
    c = c.reshape(nt, kg, LANES, 128)
    shifts = torch.arange(bits, device=c.device, dtype=torch.int64)
    index_bits = ((c[..., None] >> shifts) & 1).reshape(nt, kg, LANES, PAIRS, 2 * bits)  # bit n = e*k + b
    string = torch.empty_like(index_bits).reshape(nt, kg, LANES, 128 * bits)
    string[..., pair_bit_offsets(bits).flatten()] = index_bits.reshape(nt, kg, LANES, 128 * bits)
    string = string.reshape(nt, kg, LANES, bits, 4, 32)
    words = (string << torch.arange(32, device=c.device, dtype=torch.int64)).sum(-1)
    b_gemm = to_int32_bits(words).permute(0, 1, 3, 2, 4)  # T j v lane w
    b_gemm = b_gemm.reshape(nb, BLOCK_TILES, kg, bits, LANES, 4).transpose(1, 2).contiguous()  # block j i v lane w

    a = absmax.reshape(N, K // BLOCK_SIZE)
    a = torch.nn.functional.pad(a, (0, kg * 8 - K // BLOCK_SIZE, 0, nt * TILE_ROWS - N))
    a_gemm = a.reshape(nb, BLOCK_TILES, 2, 8, kg, 8).permute(0, 4, 1, 2, 3, 5).contiguous()  # block j i r g t
    assert tuple(b_gemm.shape) == b_shape and tuple(a_gemm.shape) == a_shape
    return b_gemm, a_gemm


def unrepack_reference(b_gemm: torch.Tensor, a_gemm: torch.Tensor, bits: int, out_features: int,
                       in_features_padded: int):
    """(B_gemm, absmax_gemm) -> storage format (packed, absmax), bit for bit."""
    N, K = out_features, in_features_padded
    nb, kg = gemm_shapes(bits, N, K)[0][:2]
    nt = nb * BLOCK_TILES
    b_gemm = b_gemm.transpose(1, 2).reshape(nt, kg, bits, LANES, 4)  # T j v lane w
    a_gemm = a_gemm.transpose(1, 2).reshape(nt, kg, 2, 8, 8)  # T j r g t
    words = b_gemm.permute(0, 1, 3, 2, 4).to(torch.int64) & 0xFFFFFFFF  # T j lane v w
    string = (words[..., None] >> torch.arange(32, device=words.device, dtype=torch.int64)) & 1
    string = string.reshape(nt, kg, LANES, 128 * bits)
    index_bits = string[..., pair_bit_offsets(bits).flatten()].reshape(nt, kg, LANES, 128, bits)
    codes = (index_bits << torch.arange(bits, device=words.device, dtype=torch.int64)).sum(-1)  # T j lane (t p r e)
    codes = codes.reshape(nt, kg, 8, 4, 8, 4, 2, 2).permute(0, 6, 2, 1, 4, 5, 3, 7)  # T r g j t p q e
    codes = codes.reshape(nt * TILE_ROWS, kg * K_GROUP)[:N, :K]
    packed = pack_bitplanes(codes.reshape(-1, BLOCK_SIZE), bits)

    a = a_gemm.permute(0, 2, 3, 1, 4).reshape(nt * TILE_ROWS, kg * 8)  # (T r g) (j t)
    absmax = a[:N, : K // BLOCK_SIZE].reshape(-1).clone()  # never a view of the input (custom-op rule)
    return packed, absmax
