// Host side of the fused GEMM: choose a configuration, size its workspace, dispatch on the bit width.
#include <algorithm>

#include "gemm_ws.cuh"

namespace kbit {

// A compile-time property of the configuration (k, mb, wgmma_tiles), or `otherwise` if it is not built.
template <typename F, typename R>
R config_property(int k, int mb, int wgmma_tiles, R otherwise, F f) {
  R r = otherwise;
  auto get = [&](auto cfg) { r = f(cfg); };
  switch (k) {
    case 2: with_gemm_config<2>(mb, wgmma_tiles, get); break;
    case 3: with_gemm_config<3>(mb, wgmma_tiles, get); break;
    case 4: with_gemm_config<4>(mb, wgmma_tiles, get); break;
    default: with_gemm_config<5>(mb, wgmma_tiles, get); break;
  }
  return r;
}

int gemm_smem_bytes(int k, int mb, int wgmma_tiles) {
  return config_property(k, mb, wgmma_tiles, 0, [](auto cfg) { return decltype(cfg)::kSmemTotal; });
}
bool gemm_on_sm80(int k, int mb, int wgmma_tiles) {
  return config_property(k, mb, wgmma_tiles, false, [](auto cfg) { return decltype(cfg)::kOnSm80; });
}

// A compile-time property of the warp-specialized configuration (k, tokens per tile).
template <typename F, typename R>
R ws_config_property(int k, int tokens, R otherwise, F f) {
  R r = otherwise;
  auto get = [&](auto cfg) { r = f(cfg); };
  switch (k) {
    case 2: with_ws_config<2>(tokens, get); break;
    case 3: with_ws_config<3>(tokens, get); break;
    case 4: with_ws_config<4>(tokens, get); break;
    default: with_ws_config<5>(tokens, get); break;
  }
  return r;
}

// Tokens per tile of the warp-specialized kernel for M tokens, or 0 for gemm.cuh's kernel. Auto takes it where it
// was measured faster than gemm.cuh's (H200, docs/PERFORMANCE.md v27): from 17 tokens on weights of >= 48M
// elements, from 33 on weights of >= 128M, from 65 on weights of >= 32M with N >= 8192 (N = 4096 splits each
// 256-row tile over many CTAs, and the split-K hand-off of 256 x 128 partials costs more than the kernel saves),
// past 128 tokens on weights of >= 32M, and past 512 everywhere. At most 16 tokens: gemm.cuh's kernel (issue 18).
int ws_tokens_for(int M, int N, int K_w, GemmPath path) {
  if (path == GemmPath::Classic) return 0;
  const int tokens = M <= 32 ? 32 : M <= 64 ? 64 : 128;
  if (path == GemmPath::WarpSpecialized) return tokens;
  const int64_t weights = static_cast<int64_t>(N) * K_w;
  const bool faster = M > 512 || (M > 128 && weights >= (int64_t{1} << 25)) ||
                      (M > 64 && N >= 8192 && weights >= (int64_t{1} << 25)) ||
                      (M > 32 && weights >= (int64_t{1} << 27)) || (M > 16 && weights >= (int64_t{48} << 20));
  return faster ? tokens : 0;
}

GemmPlan gemm_plan(int M, int N, int K_w, int k, int num_sms, int forced_grid, GemmPath path) {
  GemmPlan plan{};
  int smem_limit = 0, dev = 0, major = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  }
  const int ws_tokens = major == 9 ? ws_tokens_for(M, N, K_w, path) : 0;
  if (ws_tokens > 0) {
    const int k_groups = static_cast<int>(layout_k_groups(K_w));
    plan.ws_tokens = ws_tokens;
    plan.mb = ws_tokens / 8;
    plan.m_passes = (M + ws_tokens - 1) / ws_tokens;
    plan.smem_bytes = ws_config_property(k, ws_tokens, 0, [](auto cfg) { return decltype(cfg)::kSmemTotal; });
    plan.smem_limit = smem_limit;
    plan.cc_major = major;
    plan.built = true;
    plan.total_steps = plan.m_passes * ((N + kWsTileRows - 1) / kWsTileRows) * k_groups;
    const int want = forced_grid > 0 ? std::min(forced_grid, num_sms) : num_sms;  // one CTA per SM (finish_tile)
    plan.grid = std::max(1, std::min(want, plan.total_steps));
    const bool whole = plan.total_steps % plan.grid == 0 && (plan.total_steps / plan.grid) % k_groups == 0;
    const int partial_per_cta = ws_config_property(k, ws_tokens, 0, [](auto cfg) { return decltype(cfg)::kPartialFloats; });
    plan.partial_floats = whole ? 0 : static_cast<int64_t>(plan.grid) * partial_per_cta;
    return plan;
  }
  // 8-token MMA tiles per pass: enough for M; larger M loops over passes. mma.sync takes at most 4 (32
  // tokens: more would spill registers), wgmma (compute capability 9.x) 8 or 16. wgmma from 65 tokens on, and
  // from 33 on problems with >= 16 steps per CTA in 256-row tiles: below that mma.sync's 32-token passes are
  // faster (docs/PERFORMANCE.md, v23). wgmma takes 256-row tiles exactly on those problems: there the
  // activations' traffic from L2 bounds it and half of it goes; elsewhere the extra split-K costs more.
  const int k_groups = static_cast<int>(layout_k_groups(K_w));
  auto steps_in_256_row_tiles = [&](int mb) {
    return static_cast<int64_t>((M + mb * 8 - 1) / (mb * 8)) * ((N + 255) / 256) * k_groups;
  };
  const bool hopper = major == 9;
  const bool wgmma = hopper && (M > 64 || (M > 32 && steps_in_256_row_tiles(8) >= 16LL * num_sms));
  plan.mb = M <= 8 ? 1 : M <= 16 ? 2 : !wgmma ? 4 : M <= 64 ? 8 : 16;
  plan.wgmma_tiles = !wgmma ? 0 : plan.mb == 8 || (k != 5 && steps_in_256_row_tiles(16) >= 16LL * num_sms) ? 2 : 1;
  if (smem_limit > 0 && gemm_smem_bytes(k, plan.mb, plan.wgmma_tiles) > smem_limit) plan.mb = 4, plan.wgmma_tiles = 0;
  while (plan.mb > 1 && smem_limit > 0 && gemm_smem_bytes(k, plan.mb, 0) > smem_limit) plan.mb /= 2;
  plan.smem_bytes = gemm_smem_bytes(k, plan.mb, plan.wgmma_tiles);
  plan.smem_limit = smem_limit;
  plan.cc_major = major;
  plan.built = major == 0 || major >= 9 || gemm_on_sm80(k, plan.mb, plan.wgmma_tiles);
  plan.m_passes = (M + plan.mb * 8 - 1) / (plan.mb * 8);
  const int rows = gemm_tile_rows(k, plan.mb, plan.wgmma_tiles);
  const int n_tiles = (N + rows - 1) / rows;
  plan.total_steps = plan.m_passes * n_tiles * k_groups;
  // At most one CTA per SM, also when forced: a split tile's reducer waits for the CTAs after it (finish_tile).
  const int want = forced_grid > 0 ? std::min(forced_grid, num_sms) : num_sms;
  plan.grid = std::max(1, std::min(want, plan.total_steps));
  // Every CTA owns whole tiles only when the cut falls on tile boundaries.
  const bool whole = plan.total_steps % plan.grid == 0 && (plan.total_steps / plan.grid) % k_groups == 0;
  // One partial tile per CTA (GemmConfig::kPartialFloats): a CTA publishes at most one, see finish_tile.
  const int partial_per_cta =
      config_property(k, plan.mb, plan.wgmma_tiles, 0, [](auto cfg) { return decltype(cfg)::kPartialFloats; });
  plan.partial_floats = whole ? 0 : static_cast<int64_t>(plan.grid) * partial_per_cta;
  return plan;
}

void gemm_fill_params(GemmParams& p, const GemmPlan& plan, int N, int K_w) {
  p.N = N;
  const int rows = plan.ws_tokens ? kWsTileRows : gemm_tile_rows(p.k, plan.mb, plan.wgmma_tiles);
  p.n_tiles = (N + rows - 1) / rows;
  p.k_groups = static_cast<int>(layout_k_groups(K_w));
  p.mb = plan.mb;
  p.wgmma_tiles = plan.wgmma_tiles;
  p.ws_tokens = plan.ws_tokens;
  p.grid = plan.grid;
  p.steps_per_cta = plan.total_steps / plan.grid;
  p.extra_steps = plan.total_steps % plan.grid;
}

cudaError_t gemm(const GemmParams& p, cudaStream_t stream) {
  if (p.M == 0) return cudaSuccess;
  if (p.K_x % kXColumnAlign || p.lda % kXColumnAlign || reinterpret_cast<uintptr_t>(p.x) % 16) {
    return cudaErrorMisalignedAddress;
  }
  if (p.ws_tokens) {
    switch (p.k) {
      case 2: return gemm_ws_for_bits<2>(p, stream);
      case 3: return gemm_ws_for_bits<3>(p, stream);
      case 4: return gemm_ws_for_bits<4>(p, stream);
      case 5: return gemm_ws_for_bits<5>(p, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (p.k) {
    case 2: return gemm_for_bits<2>(p, stream);
    case 3: return gemm_for_bits<3>(p, stream);
    case 4: return gemm_for_bits<4>(p, stream);
    case 5: return gemm_for_bits<5>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kbit
