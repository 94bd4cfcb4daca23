"""Quantization methods: how a weight's codebook, block scales and codes are chosen.

The storage format (``kbit.formats``) fixes only what the stored bits mean: a per-tensor sorted codebook of
``2**k`` float32 levels with largest |value| 1, one E4M4 block scale per 32 weights of a row, a k-bit code per
weight and a per-tensor power-of-two ``scale``. Any such codebook, block scale and code is valid storage and
every kernel reproduces it bit for bit, so a better quantizer needs no kernel change. The methods:

* ``"rtn"``: the normal-float codebook, block scale = the block's absmax rounded to E4M4, nearest codes
  (``kbit.quantize``).
* ``"mse"`` (data-free): a codebook fitted to the tensor (Lloyd-Max on the block-normalized weights, alternated
  with the scale search; kept only where it beats the normal-float codebook) and, per block, the E4M4 scale that
  minimizes the block's squared error, each candidate scale with its own nearest codes. Clipping the block's
  largest weight a little usually lowers the error of the other 31.
* ``"gptq"`` (calibrated): the layer's input Hessian ``H = 2 X^T X / n`` (``kbit.calibration``) weighs the
  error. Columns are quantized one at a time, and each column's rounding error is fed back into the columns
  not yet quantized so that the layer's *output* error stays small (GPTQ), in activation order (``block_order``:
  whole blocks of 32, largest Hessian diagonal first). A block's scale is searched on its error-updated weights
  when its first column is reached; once all codes are known, the codebook is refitted to them
  (``refit_codebook``) and the block scales refined (``refine_block_scales``), both on the output error.

Every method returns a ``QuantizedWeight`` whose reference dequantization is exactly the reconstruction the
method optimized (``reconstruct``).
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch import Tensor

from ._validate import check_bits, check_codebook, check_finite, check_tensor, check_weight
from .formats import (
    BLOCK_SIZE,
    E4M4_MAX,
    choose_tensor_scale,
    create_normal_float_codebook,
    decode_absmax_e4m4,
    encode_absmax_e4m4,
    pack_bitplanes,
    padded_in_features,
)
from .weight import PrecisionWarning, QuantizedWeight, quantize_checked, warn_precision

__all__ = ["METHODS", "quantize_tensor", "fit_codebook", "search_block_scales"]

METHODS = ("rtn", "mse", "gptq")

# The scale search tries E4M4 codes from SEARCH_DOWN[k] steps below the block's absmax code (each step is a
# factor of about 1 + 1/16) up to a few above it: the best clipping of a bell-shaped block lies at about 0.5
# (2 bits) to 0.7 (5 bits) of its absmax, and fewer bits clip harder.
SEARCH_DOWN = {2: 16, 3: 12, 4: 10, 5: 8}
MAX_SEARCH_UP = 8  # codes above the absmax code: when the codebook's extreme level on one side is well below 1
FIT_ITERS = 6  # codebook fit: rounds of scale search + Lloyd update
FIT_SAMPLE_BLOCKS = 1 << 12  # the codebook is fitted on at most this many blocks (a seeded random sample)
GPTQ_BATCH = 128  # GPTQ's lazy batch: columns updated together before the rest of the matrix sees their error
REFINE_SWEEPS = 2  # coordinate-descent sweeps of refine_block_scales over all blocks (0: no refinement)
REFIT_CODEBOOK = True  # GPTQ: the codebook refitted to the chosen codes on the output error (refit_codebook)
REFIT_WEIGHTS = 1 << 23  # refit_codebook's system comes from whole rows holding at most this many weights: it
# costs 2**k products of [rows, K_pad] x [K_pad, K_pad], and 2**k levels are well determined by far fewer weights
GPTQ_DAMP = 0.1  # added to H's diagonal, as a fraction of its mean: keeps H invertible and the fit general
# The part of the fitted correction toward the unquantized model's outputs that fp_targets applies: the cross term
# comes from the calibration data alone, and the full correction fits it too closely (MiniLM K=3: share 0.25 /
# 0.5 / 0.75 / 1 / 1.5 gave mean cosine 0.9737 / 0.9755 / 0.9757 / 0.9745 / 0.9688, against 0.9723 without).
FP_TARGET_SHARE = 0.75
_CHUNK_ELEMENTS = 1 << 21  # elements per vectorized chunk of the scale search (bounds temporary memory)


# ----------------------------------------------------------------------------- nearest levels
def level_midpoints(cb: Tensor) -> Tensor:
    """The decision boundaries of sorted ``cb``: a value above midpoint i is nearer level i + 1."""
    return (cb[1:] + cb[:-1]) * 0.5


def nearest_levels(v: Tensor, cb: Tensor, midpoints: Optional[Tensor] = None) -> Tensor:
    """Index of the level of sorted ``cb`` nearest to each ``v`` (ties to the lower level, as ``formats``);
    ``midpoints``: ``level_midpoints(cb)``, when the caller has them."""
    return torch.bucketize(v, level_midpoints(cb) if midpoints is None else midpoints)


def _codes_for(x: Tensor, d: Tensor, cb: Tensor) -> Tensor:
    """Nearest codes of blocks ``x`` [..., 32] for decoded block scales ``d`` [...] (0 for d == 0)."""
    recip = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    return nearest_levels(x * recip[..., None], cb)


# ----------------------------------------------------------------------------- block scale search
def _search_offsets(cb: Tensor, k: int):
    """(lowest, highest) E4M4 code offset from a block's absmax code that the scale search tries."""
    small_side = float(min(-cb[0], cb[-1]))  # the extreme level on the side of 0 that does not reach 1
    up = 1
    if 0 < small_side < 1:  # a block whose absmax lies on that side fits only with d = absmax / small_side
        up = min(MAX_SEARCH_UP, 1 + math.ceil(math.log(1.0 / small_side) / math.log(1.0 + 1.0 / 16.0)))
    return -SEARCH_DOWN[k], up


def _candidate_errors(xb: Tensor, wb: Optional[Tensor], codes: Tensor, cb: Tensor, peak: float,
                      limit: Optional[float]) -> Tensor:
    """Per block and candidate: the (weighted) squared error of blocks ``xb`` [nb, 32] with block scale codes
    ``codes`` [nb, C] and nearest codes, [nb, C] (inf past ``limit``)."""
    d = decode_absmax_e4m4(codes.clamp(0, 255).to(torch.uint8))
    x = xb[:, None, :]
    r = x - cb[_codes_for(x, d, cb)] * d[..., None]
    r = r * r
    if wb is not None:
        r = r * (wb if wb.dim() == 1 else wb[:, None, :])
    err = r.sum(dim=2)
    if limit is not None:
        err = torch.where(d * peak > limit, float("inf"), err)
    return err


def _first_best(codes: Tensor, errs: Tensor) -> tuple:
    """(code, error) of the first smallest error per row, as a scan keeping strictly smaller errors would choose
    (NaN errors never chosen)."""
    errs = torch.where(torch.isnan(errs), float("inf"), errs)
    i = errs.argmin(dim=1, keepdim=True)
    return codes.gather(1, i).squeeze(1), errs.gather(1, i).squeeze(1)


def search_block_scales(x: Tensor, cb: Tensor, k: int, weight: Optional[Tensor] = None,
                        limit: Optional[float] = None) -> Tensor:
    """Per block of ``x`` [nb, 32], an E4M4 code minimizing ``sum(weight * (x - cb[code] * d)**2)``.

    ``x`` is already divided by the tensor scale; each candidate ``d`` gets its own nearest codes. ``weight``:
    None, [32] or [nb, 32] non-negative error weights. ``limit``: the largest allowed ``d * max|cb|`` (keeps
    reconstructions finite in the weight's dtype). Coarse to fine: every other code from ``SEARCH_DOWN[k]`` below
    the block's absmax code to a few above it, then the two neighbours of the best. The absmax code is tried
    first and kept on ties, so the result is never worse than plain rounding with the same codebook. Each stage's
    candidates are scored together (GPTQ calls this once per block of columns: on a GPU, launches are its cost).
    """
    cb = cb.to(device=x.device, dtype=torch.float32)
    low, high = _search_offsets(cb, k)
    offsets = [0] + [o for o in range(low, high + 1, 2) if o != 0]  # the absmax code first: kept on ties
    coarse = torch.tensor(offsets, dtype=torch.int32, device=x.device)
    fine = torch.tensor([0, -1, 1], dtype=torch.int32, device=x.device)
    peak = float(cb.abs().max())
    out = torch.empty(x.shape[0], dtype=torch.uint8, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // (BLOCK_SIZE * len(offsets)))
    for s in range(0, x.shape[0], step):
        xb = x[s:s + step]
        wb = weight if weight is None or weight.dim() == 1 else weight[s:s + step]
        base = encode_absmax_e4m4(xb.abs().amax(dim=1)).to(torch.int32)
        codes = (base[:, None] + coarse).clamp(0, 255)
        best, best_err = _first_best(codes, _candidate_errors(xb, wb, codes, cb, peak, limit))
        codes = (best[:, None] + fine).clamp(0, 255)  # the best so far first: kept on ties
        errs = _candidate_errors(xb, wb, codes[:, 1:], cb, peak, limit)
        best, _ = _first_best(codes, torch.cat([best_err[:, None], errs], dim=1))
        out[s:s + step] = best.to(torch.uint8)
    return out


def _weighted_error(x: Tensor, cb: Tensor, absmax: Tensor, weight: Optional[Tensor]) -> float:
    d = decode_absmax_e4m4(absmax)
    r = x - cb[_codes_for(x, d, cb)] * d[:, None]
    r = r * r
    return float((r if weight is None else r * weight).sum())


# ----------------------------------------------------------------------------- codebook fit
MIN_LEVEL_GAP = 2.0**-8  # of the normalized levels: several fp16 steps, so rounding to fp16 keeps them apart


def _valid_codebook(c: Tensor) -> Tensor:
    """Sorted, strictly increasing, largest |value| exactly 1, every level an fp16 value: the fp16 kernel's tables
    then hold exactly the stored levels (as for the normal-float codebook, ``formats``)."""
    c = torch.sort(c.to(torch.float64)).values
    c = c / c.abs().max()
    for i in range(1, c.numel()):
        if c[i] - c[i - 1] < MIN_LEVEL_GAP:
            c[i] = c[i - 1] + MIN_LEVEL_GAP
    c = c / c.abs().max()  # m / m == 1 exactly
    return c.to(torch.float16).to(torch.float32)


def fit_codebook(x: Tensor, k: int, weight: Optional[Tensor] = None, iters: int = FIT_ITERS,
                 sample_blocks: int = FIT_SAMPLE_BLOCKS, seed: int = 0) -> Tensor:
    """A codebook for blocks ``x`` [nb, 32]: Lloyd-Max on the block-normalized weights, alternated with scales.

    Each round chooses every block's scale for the current codebook (``search_block_scales``), then moves each
    level to the mean of the normalized values ``x / d`` nearest to it, weighted by ``d**2 * weight`` (their
    squared error in weight units), and rescales the levels to largest |value| 1. Starts from the normal-float
    codebook and returns the round's codebook with the smallest error (the start included).
    """
    device = x.device
    if x.shape[0] > sample_blocks:
        pick = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:sample_blocks]
        x = x[pick.to(device)]
        if weight is not None and weight.dim() == 2:
            weight = weight[pick.to(device)]
    w = torch.ones_like(x) if weight is None else weight.expand_as(x)
    cb = create_normal_float_codebook(k, device=device)
    best_cb, best_err = cb, math.inf
    for it in range(iters + 1):
        absmax = search_block_scales(x, cb, k, weight)
        err = _weighted_error(x, cb, absmax, weight)
        if err < best_err:
            best_cb, best_err = cb, err
        if it == iters:
            break
        d = decode_absmax_e4m4(absmax)
        keep = d > 0
        xs, ds, ws = x[keep], d[keep, None], w[keep]
        idx = _codes_for(xs, ds[:, 0], cb).reshape(-1)
        wt = (ws * ds * ds).reshape(-1).double()
        v = (xs / ds).reshape(-1).double()
        num = torch.zeros(2**k, dtype=torch.float64, device=device).index_add_(0, idx, wt * v)
        den = torch.zeros(2**k, dtype=torch.float64, device=device).index_add_(0, idx, wt)
        cb = _valid_codebook(torch.where(den > 0, num / den.clamp(min=1e-300), cb.double()))
    return best_cb


# ----------------------------------------------------------------------------- shared steps
def _normalized(W: Tensor):
    """(W in float32 divided by its tensor scale and zero-padded to [N, K_pad], the tensor scale)."""
    K = W.shape[1]
    Wf = W.detach().to(torch.float32)
    scale = choose_tensor_scale(Wf.abs().amax())
    x = Wf * (1.0 / scale)
    in_features_padded = padded_in_features(K)
    if in_features_padded != K:
        x = torch.nn.functional.pad(x, (0, in_features_padded - K))
    return x.contiguous(), scale


def _limit(dtype: torch.dtype, scale: Tensor) -> float:
    """Largest block scale times codebook peak whose reconstruction stays finite in ``dtype``."""
    return min(torch.finfo(dtype).max / float(scale), E4M4_MAX)


def _storage(codes: Tensor, absmax: Tensor, cb: Tensor, scale: Tensor, k: int, shape, dtype) -> QuantizedWeight:
    """A QuantizedWeight from codes [N, K_pad] and block scale codes [N, K_pad / 32]."""
    packed = pack_bitplanes(codes.reshape(-1, BLOCK_SIZE), k)
    return QuantizedWeight.from_checked(packed.contiguous(), absmax.reshape(-1).contiguous(), cb.contiguous(),
                                        scale.reshape(()).to(torch.float32), k, tuple(shape), dtype)


def _warn_zeroed(x_blocks: Tensor, absmax: Tensor, name: str) -> None:
    zeroed = int(((x_blocks.abs().amax(dim=1) > 0) & (decode_absmax_e4m4(absmax) == 0)).sum())
    if zeroed:
        warnings.warn(
            f"{name}: {zeroed} of {absmax.numel()} blocks have a block scale that rounds to zero: the weight spans "
            f"more than E4M4's dynamic range (2**19 between its largest and smallest block absmax)",
            PrecisionWarning, stacklevel=4,
        )


def _choose_codebook(blocks: Tensor, k: int, weight: Optional[Tensor], limit: float):
    """(codebook, block scale codes) for the whole tensor: ``fit_codebook``'s choice, scales searched for it."""
    cb = fit_codebook(blocks, k, weight)
    return cb, search_block_scales(blocks, cb, k, weight, limit)


# ----------------------------------------------------------------------------- mse
def quantize_mse(W: Tensor, k: int, codebook: Optional[Tensor] = None, name: str = "W") -> QuantizedWeight:
    """Data-free: fitted codebook (unless ``codebook`` is given) and error-minimizing block scales."""
    N, K = W.shape
    x, scale = _normalized(W)
    blocks = x.reshape(-1, BLOCK_SIZE)
    weight = None
    if K % BLOCK_SIZE:  # padded columns are not weights: their error does not count
        col = (torch.arange(x.shape[1], device=x.device) < K).to(torch.float32)
        weight = col.expand(N, -1).reshape(-1, BLOCK_SIZE)
    limit = _limit(W.dtype, scale)
    if codebook is None:
        cb, absmax = _choose_codebook(blocks, k, weight, limit)
    else:
        cb = codebook.to(device=W.device, dtype=torch.float32)
        absmax = search_block_scales(blocks, cb, k, weight, limit)
    _warn_zeroed(blocks, absmax, name)
    codes = _codes_for(blocks, decode_absmax_e4m4(absmax), cb)
    return _storage(codes, absmax, cb, scale, k, (N, K), W.dtype)


# ----------------------------------------------------------------------------- gptq
def damped_hessian(H: Tensor, damp: float) -> Tensor:
    """``H`` in float64 (a copy) as GPTQ inverts it: inputs that calibration never reached (zero diagonal; padded
    columns too) get a unit diagonal and no coupling, and every diagonal ``damp`` times the live inputs' mean."""
    H = H.to(torch.float64).clone()
    dead = torch.diagonal(H) <= 0
    H[dead, :] = 0.0
    H[:, dead] = 0.0
    live_mean = float(torch.diagonal(H)[~dead].mean()) if bool((~dead).any()) else 1.0
    torch.diagonal(H)[dead] = 1.0
    torch.diagonal(H).add_(damp * live_mean)
    return H


def _inverse_hessian_factor(H: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factor U of the damped inverse Hessian (H^-1 = U^T U, ``damped_hessian``), float32: the
    dead inputs' columns are rounded to nearest and pass no error on."""
    L = torch.linalg.cholesky(damped_hessian(H, damp))
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).to(torch.float32)


def weight_for_fp_inputs(W: Tensor, H: Tensor, cross: Tensor, damp: float = GPTQ_DAMP,
                         share: float = FP_TARGET_SHARE) -> Tensor:
    """The weight whose outputs on the inputs calibration gave a layer best match the unquantized model's outputs.

    The layer sees inputs ``X`` (made by the quantized layers before it), the unquantized model ``X_fp``. With
    ``H = 2 X^T X / n`` and ``cross = 2 (X_fp - X)^T X / n``, ``W + W cross (H + damp)^-1`` is the least-squares
    fit of ``X_fp W^T`` by ``X W*^T`` (damped as GPTQ damps ``H``). Its residual is orthogonal to every weight's
    outputs on ``X``, so GPTQ of ``W*`` on ``H`` minimizes ``|X_fp W^T - X Q^T|^2``: the error that the layers
    before left is corrected here too, instead of being carried on. Returned: ``W`` plus ``share`` of that
    correction (``FP_TARGET_SHARE``), float32 [N, K] of ``W``'s shape.
    """
    W64 = W.to(torch.float64)
    rhs = (W64 @ cross.to(device=W.device, dtype=torch.float64)).T  # H is symmetric: (W C H^-1)^T = H^-1 (W C)^T
    correction = torch.cholesky_solve(rhs, torch.linalg.cholesky(damped_hessian(H, damp))).T
    return (W64 + share * correction).to(torch.float32)


def block_order(hessian_diag: Tensor) -> Tensor:
    """GPTQ's activation order within kbit's blocks: a permutation of the (padded) columns.

    Blocks of 32 stay whole, since each has one scale: blocks in decreasing order of their summed Hessian
    diagonal, and the columns inside each block in decreasing order of their own. The columns that matter most
    are quantized first, while many others are left to absorb their error.
    """
    in_features_padded = hessian_diag.numel()
    d = hessian_diag.reshape(in_features_padded // BLOCK_SIZE, BLOCK_SIZE)
    blocks = torch.argsort(d.sum(dim=1), descending=True, stable=True)
    inside = torch.argsort(d[blocks], dim=1, descending=True, stable=True)
    return (blocks[:, None] * BLOCK_SIZE + inside).reshape(-1)


def refine_block_scales(x: Tensor, codes: Tensor, absmax: Tensor, cb: Tensor, H: Tensor, limit: float,
                        sweeps: int = REFINE_SWEEPS) -> Tensor:
    """Block scale codes [N, K_pad / 32] that lower the output error ``tr((x - x_hat) H (x - x_hat)^T)`` with the
    codes kept: coordinate descent over each block's E4M4 neighbours (one and two steps up and down).

    ``x`` [N, K_pad]: the normalized weights; ``H`` [K_pad, K_pad]. GPTQ chooses each block's scale before the error
    feedback of its own columns has landed; afterwards a slightly different scale often fits the block better.
    """
    N, in_features_padded = x.shape
    peak = float(cb.abs().max())
    q = cb[codes]  # [N, K_pad] levels
    absmax = absmax.clone()
    d = decode_absmax_e4m4(absmax)
    g = (x - q * d.repeat_interleave(BLOCK_SIZE, dim=1)) @ H  # (x - x_hat) H: dE/d(x_hat) = -2 g
    steps = torch.tensor([-2, -1, 1, 2], dtype=torch.int32, device=x.device)  # the E4M4 neighbours tried
    for _ in range(sweeps):
        for b in range(in_features_padded // BLOCK_SIZE):
            J = slice(b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE)
            qJ, HJ = q[:, J], H[J, J]
            lin = (qJ * g[:, J]).sum(dim=1)  # q_J . (H r)_J
            quad = ((qJ @ HJ) * qJ).sum(dim=1)  # q_J^T H_JJ q_J
            # The four neighbours at once (a handful of kernels, not four times as many: on a GPU this loop is
            # launch-bound); the first of the largest positive gains wins, as in a scan that keeps strict gains.
            code = (absmax[:, b, None].to(torch.int32) + steps).clamp(0, 255)  # [N, 4]
            cand = decode_absmax_e4m4(code.to(torch.uint8))
            ds = cand - d[:, b, None]
            gain = 2.0 * ds * lin[:, None] - ds * ds * quad[:, None]  # the error's decrease
            gain = torch.where((gain > 0) & (cand * peak <= limit), gain, -math.inf)
            best = gain.argmax(dim=1, keepdim=True)
            take = torch.isfinite(gain.gather(1, best)).squeeze(1)
            best_code = torch.where(take, code.gather(1, best).squeeze(1), absmax[:, b].to(torch.int32))
            new_d = torch.where(take, cand.gather(1, best).squeeze(1), d[:, b])
            delta = qJ * (new_d - d[:, b])[:, None]  # x_hat's change on the block (zero where the scale stays)
            g -= delta @ H[J, :]
            absmax[:, b] = best_code.to(torch.uint8)
            d[:, b] = new_d
    return absmax


def refit_codebook(x: Tensor, codes: Tensor, absmax: Tensor, cb: Tensor, H: Tensor) -> Tensor:
    """The codebook that minimizes the output error ``tr((x - x_hat) H (x - x_hat)^T)`` with the codes and block
    scales kept, or ``cb`` where that one is not a valid codebook or not better.

    ``x_hat = sum_l c_l M_l`` (``M_l``: the block scales where the code is l, 0 elsewhere) is linear in the levels
    ``c``, so the error is the quadratic ``c^T A c - 2 b^T c + const`` with ``A_lm = <M_l, M_m H>`` and
    ``b_l = <M_l, x H>``: one small linear solve, the (first) level at |value| 1 held fixed (the format's
    normalization); levels no code uses keep their value.
    GPTQ's codebook is fitted to the weights before the error feedback moves them; this fits it to the codes GPTQ
    chose. On a weight of more than ``REFIT_WEIGHTS`` weights, ``A`` and ``b`` come from a seeded random sample of
    as many whole rows as that allows (``A`` costs ``2**k`` products of [rows, K_pad] x [K_pad, K_pad]).
    """
    n_levels = cb.numel()
    rows = max(1, REFIT_WEIGHTS // x.shape[1])
    if x.shape[0] > rows:
        pick = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:rows].to(x.device)
        x, codes, absmax = x[pick], codes[pick], absmax[pick]
    D = decode_absmax_e4m4(absmax).repeat_interleave(BLOCK_SIZE, dim=1)
    flat_codes = codes.reshape(-1)
    A = torch.zeros(n_levels, n_levels, dtype=torch.float64, device=x.device)
    for level in range(n_levels):
        M = torch.where(codes == level, D, 0.0)
        A[level] = torch.zeros(n_levels, dtype=torch.float64, device=x.device).index_add_(
            0, flat_codes, ((M @ H) * D).reshape(-1).double())
    b = torch.zeros(n_levels, dtype=torch.float64, device=x.device).index_add_(
        0, flat_codes, ((x @ H) * D).reshape(-1).double())
    A = 0.5 * (A + A.T)
    cb64 = cb.double()
    peak = int(cb64.abs().argmax())
    free = [i for i in range(n_levels) if i != peak and float(A[i, i]) > 0]  # unused levels keep their value
    if not free:
        return cb
    fixed = [i for i in range(n_levels) if i not in free]
    new = cb64.clone()
    try:
        new[free] = torch.linalg.solve(A[free][:, free], b[free] - A[free][:, fixed] @ cb64[fixed])
    except RuntimeError:  # singular: keep the codebook
        return cb
    new = new.to(torch.float16).double()  # fp16 levels (as _valid_codebook); the peak stays exactly +-1
    if not bool((new[1:] - new[:-1] >= MIN_LEVEL_GAP).all()) or float(new.abs().max()) != 1.0:
        return cb

    def error(c):  # up to the constant tr(x H x^T)
        return float(c @ A @ c - 2.0 * b @ c)

    return new.to(torch.float32) if error(new) < error(cb64) else cb


def _gptq_pass(x_pad: Tensor, U: Tensor, perm: Tensor, cb: Tensor, k: int, cost: Tensor, limit: float,
               absmax: Optional[Tensor] = None):
    """One GPTQ sweep over the columns in order ``perm``: (codes [N, K_pad], block scale codes [N, K_pad / 32]).

    Each block's scale is searched when its first column is reached, unless ``absmax`` gives them all.
    """
    N, in_features_padded = x_pad.shape
    device = x_pad.device
    search = absmax is None
    if search:
        absmax = torch.zeros(N, in_features_padded // BLOCK_SIZE, dtype=torch.uint8, device=device)
    x = x_pad[:, perm]  # updated in place: column j holds the original weights plus the feedback so far
    codes = torch.zeros(N, in_features_padded, dtype=torch.int64, device=device)
    # The column loop is launch-bound on a GPU: what does not change per column is computed outside it.
    mids = level_midpoints(cb)
    for i1 in range(0, in_features_padded, GPTQ_BATCH):
        i2 = min(i1 + GPTQ_BATCH, in_features_padded)
        xb = x[:, i1:i2]  # a view: corrections inside the batch land in x directly
        errs = torch.zeros(N, i2 - i1, device=device)
        Ub = U[i1:i2, i1:i2]
        batch_codes = []
        for j in range(i2 - i1):
            col = i1 + j
            if col % BLOCK_SIZE == 0:
                b = int(perm[col]) // BLOCK_SIZE  # the original block these 32 columns form
                if search:
                    absmax[:, b] = search_block_scales(x[:, col:col + BLOCK_SIZE], cb, k,
                                                       cost[col:col + BLOCK_SIZE], limit)
                d = decode_absmax_e4m4(absmax[:, b])
                recip = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
            c = nearest_levels(xb[:, j] * recip, cb, mids)
            batch_codes.append(c)
            e = (xb[:, j] - cb[c] * d) / Ub[j, j]
            xb[:, j + 1:].addr_(e, Ub[j, j + 1:], alpha=-1.0)
            errs[:, j] = e
        codes[:, i1:i2] = torch.stack(batch_codes, dim=1)
        if i2 < in_features_padded:
            x[:, i2:].addmm_(errs, U[i1:i2, i2:], alpha=-1.0)
    codes[:, perm] = codes.clone()  # back to the weight's own column order
    return codes, absmax


def quantize_gptq(W: Tensor, H: Tensor, k: int, codebook: Optional[Tensor] = None, name: str = "W",
                  damp: float = GPTQ_DAMP, act_order: bool = True) -> QuantizedWeight:
    """Calibrated: GPTQ's column-by-column quantization with error feedback, in kbit's blocks of 32.

    With U the upper Cholesky factor of H^-1, quantizing column j costs ``err**2 / U[j, j]**2`` of output error,
    and the columns after j absorb it best by subtracting ``err / U[j, j] * U[j, j+1:]``. Corrections inside a
    batch of ``GPTQ_BATCH`` columns are applied at once, the rest of the matrix sees a batch's error at its end.
    The codebook is fitted as for ``"mse"`` with each column's error weighted by ``H[j, j]``; a block's scale is
    the scale search's choice on the block's updated weights, each column weighted by its cost ``1 / U[j, j]**2``;
    then ``refit_codebook`` refits a fitted codebook (not a given one) and ``refine_block_scales`` the scales to the
    final codes, both on the output error with the damped Hessian.
    ``act_order``: columns in ``block_order``, else in their own order. ``damp``: added to H's diagonal, as a
    fraction of its mean.
    """
    N, K = W.shape
    device = W.device
    x_pad, scale = _normalized(W)
    in_features_padded = x_pad.shape[1]
    limit = _limit(W.dtype, scale)
    pad = in_features_padded - K
    H = torch.nn.functional.pad(H.to(device=device, dtype=torch.float32), (0, pad, 0, pad))
    hd = torch.diagonal(H).clamp(min=0)
    if codebook is None:
        col_w = hd / hd[:K].mean().clamp(min=1e-30)
        cb, _ = _choose_codebook(x_pad.reshape(-1, BLOCK_SIZE), k, col_w.expand(N, -1).reshape(-1, BLOCK_SIZE),
                                 limit)
    else:
        cb = codebook.to(device=device, dtype=torch.float32)
    perm = block_order(hd) if act_order else torch.arange(in_features_padded, device=device)
    U = _inverse_hessian_factor(H[perm][:, perm], damp)  # padded columns are dead inputs: no coupling
    real = perm < K
    cost = torch.where(real, 1.0 / torch.diagonal(U) ** 2, 0.0)  # padded columns cost nothing
    cost = cost / cost[real].mean()

    codes, absmax = _gptq_pass(x_pad, U, perm, cb, k, cost, limit)
    H_damped = H.clone()
    H_damped.diagonal().add_(damp * float(hd[:K].mean()))
    if codebook is None and REFIT_CODEBOOK:
        cb = refit_codebook(x_pad, codes, absmax, cb, H_damped)
    if REFINE_SWEEPS:
        absmax = refine_block_scales(x_pad, codes, absmax, cb, H_damped, limit)
    _warn_zeroed(x_pad.reshape(-1, BLOCK_SIZE), absmax.reshape(-1), name)
    return _storage(codes, absmax, cb, scale, k, (N, K), W.dtype)


# ----------------------------------------------------------------------------- one tensor
def check_method(method) -> str:
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, one of {METHODS}, got {type(method).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def quantize_tensor(W: Tensor, bits: int = 4, method: str = "rtn", codebook: Optional[Tensor] = None,
                    hessian: Optional[Tensor] = None, *, name: str = "W") -> QuantizedWeight:
    """Quantize an [N, K] weight (fp16/bf16/fp32) with ``method``, on the weight's device.

    ``codebook``: a fixed codebook (2**bits sorted levels, largest |value| 1); None means normal-float for ``"rtn"``
    and a fitted one for the others. ``hessian``: the [K, K] input Hessian ``2 X^T X / n`` of the layer
    (``kbit.calibration.collect_hessians``), required by ``"gptq"`` and refused by the others.
    """
    method = check_method(method)
    bits = check_bits(bits)
    codebook = None if codebook is None else check_codebook(codebook, bits)
    return quantize_tensor_checked(W, bits, method, codebook, hessian, name)


def quantize_tensor_checked(W: Tensor, bits: int, method: str, codebook: Optional[Tensor] = None,
                            hessian: Optional[Tensor] = None, name: str = "W") -> QuantizedWeight:
    """``quantize_tensor`` for ``bits``, ``method`` and ``codebook`` checked already (``kbit.quantize_model``'s);
    the weight and the Hessian, data, are checked here."""
    check_weight(W, name)
    if codebook is not None:
        codebook = codebook.to(W.device)
    if (hessian is not None) != (method == "gptq"):
        raise ValueError("hessian is required by method='gptq' and used by no other method, "
                         f"got method={method!r} and hessian={'a tensor' if hessian is not None else None}")
    with torch.no_grad():
        if method == "rtn":
            qw, loss = quantize_checked(W, bits, codebook)
            warn_precision(loss, name)
            return qw
        if method == "mse":
            return quantize_mse(W, bits, codebook, name)
        check_tensor(hessian, "hessian")
        if tuple(hessian.shape) != (W.shape[1],) * 2 or not hessian.is_floating_point():
            raise ValueError(f"hessian must be a floating-point [{W.shape[1]}, {W.shape[1]}] tensor for a weight "
                             f"with {W.shape[1]} input features, got {hessian.dtype} {tuple(hessian.shape)}")
        check_finite(hessian, "hessian")
        return quantize_gptq(W, hessian, bits, codebook, name)
