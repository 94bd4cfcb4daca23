// Host side of the fused GEMM: what each built configuration needs, the launch the planner chose (kbit/planner.py)
// checked and sized, dispatch on the bit width.
#include <algorithm>
#include <climits>

#include "gemm_ws.cuh"

namespace kbit {

// wgmma and setmaxnreg are sm_90a features: that code is built for compute capability 9.x only. mma.sync code is
// built for 9.0 and newer, and for sm_80-class GPUs where the configuration fits their shared memory
// (GemmConfig::kOnSm80); gemm_kernel's kBuilt and _build.py's architecture list say the same.
constexpr int kHopperMajor = 9;
constexpr int kSm80Major = 8;

// Calls f(cfg) with the compile-time configuration (k, mb, wgmma_tiles, k_split, ws_tokens) if it is built; returns
// whether it is. with_gemm_config and with_ws_config are the lists; this is their one entry point on the host.
template <typename F>
bool with_config(int k, int mb, int wgmma_tiles, int k_split, int ws_tokens, F&& f) {
  if (ws_tokens > 0) {
    if (mb * 8 != ws_tokens || k_split != 1) return false;
    return with_bits(k, false, [&](auto bits) {
      return with_ws_config<decltype(bits)::value>(ws_tokens, wgmma_tiles, f);
    });
  }
  return with_bits(k, false, [&](auto bits) {
    return with_gemm_config<decltype(bits)::value>(mb, wgmma_tiles, k_split, f);
  });
}

// What the host needs of a configuration beyond its own constants: the compute capabilities (major) its code is
// built for.
template <class Cfg>
struct HostFacts {
  static constexpr int kCcMajorMin = Cfg::kWgmma || !Cfg::kOnSm80 ? kHopperMajor : kSm80Major;
  static constexpr int kCcMajorMax = Cfg::kWgmma ? kHopperMajor : INT_MAX;
};
template <int BITS, int NT, int GROUPS>
struct HostFacts<WsConfig<BITS, NT, GROUPS>> {
  static constexpr int kCcMajorMin = kHopperMajor, kCcMajorMax = kHopperMajor;
};

bool gemm_config_info(int k, int mb, int wgmma_tiles, int k_split, int ws_tokens, GemmConfigInfo* info) {
  return with_config(k, mb, wgmma_tiles, k_split, ws_tokens, [&](auto cfg) {
    using Cfg = decltype(cfg);
    info->bits = k, info->mb = mb, info->wgmma_tiles = wgmma_tiles, info->k_split = k_split;
    info->ws_tokens = ws_tokens;
    info->tile_rows = Cfg::kTileRows;
    info->smem_bytes = Cfg::kSmemTotal;
    info->cc_major_min = HostFacts<Cfg>::kCcMajorMin;
    info->cc_major_max = HostFacts<Cfg>::kCcMajorMax;
  });
}

std::vector<GemmConfigInfo> gemm_configs() {
  std::vector<GemmConfigInfo> all;
  // Every key the lists could hold; each list says which it has.
  for (int k = 2; k <= 5; ++k) {
    for (int mb = 1; mb <= 16; ++mb) {
      for (int wgmma_tiles = 0; wgmma_tiles <= 2; ++wgmma_tiles) {
        for (int k_split : {1, kGemmWarps}) {
          GemmConfigInfo info{};
          if (gemm_config_info(k, mb, wgmma_tiles, k_split, 0, &info)) all.push_back(info);
        }
      }
    }
    for (int ws_tokens = 8; ws_tokens <= 256; ws_tokens += 8) {
      for (int tiles128 = 0; tiles128 <= 1; ++tiles128) {
        GemmConfigInfo info{};
        if (gemm_config_info(k, ws_tokens / 8, tiles128, 1, ws_tokens, &info)) all.push_back(info);
      }
    }
  }
  return all;
}

int gemm_smem_bytes(int k, int mb, int wgmma_tiles) {
  GemmConfigInfo info{};
  return gemm_config_info(k, mb, wgmma_tiles, 1, 0, &info) ? info.smem_bytes : 0;
}
bool gemm_on_sm80(int k, int mb, int wgmma_tiles) {
  GemmConfigInfo info{};
  return gemm_config_info(k, mb, wgmma_tiles, 1, 0, &info) && info.cc_major_min <= kSm80Major;
}

GemmPlan gemm_plan(int M, int N, int K_w, int k, int mb, int wgmma_tiles, int k_split, int ws_tokens,
                   const GemmLaunch& launch, int num_sms) {
  GemmPlan plan{};
  int dev = 0, l2_bytes = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    cudaDeviceGetAttribute(&plan.smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    cudaDeviceGetAttribute(&plan.cc_major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, dev);
  }
  GemmConfigInfo info{};
  if (!gemm_config_info(k, mb, wgmma_tiles, k_split, ws_tokens, &info)) return plan;  // not built: plan.built stays false
  int partial_per_cta = 0;
  with_config(k, mb, wgmma_tiles, k_split, ws_tokens, [&](auto cfg) {
    partial_per_cta = decltype(cfg)::kPartialFloats;  // gemm.cuh: one partial tile (finish_tile); gemm_ws.cuh: two slots
  });
  plan.mb = mb;
  plan.wgmma_tiles = wgmma_tiles;
  plan.k_split = k_split;
  plan.ws_tokens = ws_tokens;
  plan.tile_rows = info.tile_rows;
  plan.smem_bytes = info.smem_bytes;
  plan.built = plan.cc_major >= info.cc_major_min && plan.cc_major <= info.cc_major_max;
  const int k_steps = gemm_k_steps(K_w, k_split);
  plan.m_passes = (M + mb * 8 - 1) / (mb * 8);
  const int tiles = plan.m_passes * ((N + info.tile_rows - 1) / info.tile_rows);
  plan.total_steps = tiles * k_steps;
  // Read once by one token pass and more than L2 holds: the kernels stream them evict-first
  // (GemmConfig::kWeightsStreamed up to 16 tokens, ws_copy_weights past). Codes and E4M4 block scales.
  const int64_t weight_bytes = static_cast<int64_t>(N) * K_w * k / 8 + static_cast<int64_t>(N) * K_w / 32;
  plan.weights_stream = plan.m_passes == 1 && l2_bytes > 0 && weight_bytes > l2_bytes;
  if (M == 0) return plan;  // nothing runs: no launch to check
  plan.grid = launch.grid;
  const int parts = launch.tile_parts;
  const bool ws = ws_tokens > 0;  // the warp-specialized kernel; else gemm.cuh's
  // Hard limits only. At most one CTA per SM: a split tile's reducer waits for the CTAs after it (finish_tile), in the
  // warp-specialized kernel every CTA of the tile for all the others (ws_reduce_slice). gemm.cuh's kernels cut their
  // steps in one group (steps_of<false>), or in tile parts, one group per tile, each tile's parts one thread-block
  // cluster (GemmConfig::kClustered): mma.sync up to 16 tokens, on sm_90, at most a portable cluster's CTAs.
  if (launch.grid < 1 || launch.grid > num_sms) {
    plan.refused = "needs 1 CTA to one per SM";
  } else if (launch.grid > plan.total_steps) {
    plan.refused = "has more CTAs than steps";
  } else if (launch.whole_tiles && !ws) {
    plan.refused = "gives whole tiles to CTAs, which only the warp-specialized kernel does";
  } else if (parts != 0 && !ws && (wgmma_tiles != 0 || mb > 2)) {
    plan.refused = "cuts tiles in parts, which gemm.cuh's kernels do with mma.sync up to 16 tokens only (mb <= 2, "
                   "wgmma_tiles = 0)";
  } else if (parts != 0 && !ws && plan.cc_major < kHopperMajor) {
    plan.refused = "cuts tiles in parts summed in thread-block clusters, which need compute capability 9.0 or newer";
  } else if (parts != 0 && !ws && parts > kMaxClusterCtas) {
    plan.refused = "cuts tiles in more parts than one thread-block cluster holds (8)";
  } else if (parts != 0 && (launch.whole_tiles || parts < 2 || parts > k_steps || launch.grid != tiles * parts ||
                            launch.grid > kMaxGroupedGrid)) {
    plan.refused = "cuts tiles in parts that are not 2 to k-steps per tile on tiles x parts CTAs (at most 256)";
  } else if (launch.whole_tiles && launch.grid > tiles) {
    plan.refused = "gives whole tiles to more CTAs than tiles";
  }
  if (plan.refused) return plan;
  plan.cut_group = parts > 0 ? parts : plan.grid;
  plan.cut_unit = launch.whole_tiles ? k_steps : 1;  // cut in tiles (cut.h)
  plan.clustered = !ws && parts > 0;
  // Every CTA owns whole tiles only when the cut falls on tile boundaries; clustered, the parts meet in shared memory.
  const bool whole = plan.cut_unit == k_steps ||
                     (plan.total_steps % plan.grid == 0 && (plan.total_steps / plan.grid) % k_steps == 0);
  plan.partial_floats = whole || plan.clustered ? 0 : static_cast<int64_t>(plan.grid) * partial_per_cta;
  return plan;
}

void gemm_fill_params(GemmParams& p, const GemmPlan& plan, int N, int K_w) {
  p.N = N;
  p.n_tiles = (N + plan.tile_rows - 1) / plan.tile_rows;
  p.k_groups = static_cast<int>(layout_k_groups(K_w));
  p.k_steps = gemm_k_steps(K_w, plan.k_split);
  p.mb = plan.mb;
  p.wgmma_tiles = static_cast<uint8_t>(plan.wgmma_tiles);
  p.k_split = plan.k_split;
  p.ws_tokens = plan.ws_tokens;
  p.grid = plan.grid;
  const StreamKCut cut = make_cut(plan.total_steps / plan.cut_unit, plan.grid, plan.cut_group, plan.cut_unit);
  p.steps_per_cta = cut.steps_per_cta;
  p.extra_steps = cut.extra_steps;
  p.cut_group = static_cast<uint16_t>(cut.group);
  p.cut_group_reciprocal = static_cast<uint16_t>(cut.group_reciprocal);
  p.cut_unit = static_cast<uint16_t>(cut.unit);
  p.weights_stream = plan.weights_stream;
  p.clusters = plan.clustered ? ClusterUse::kRequired : ClusterUse::kL2;  // the binding sets the warp-specialized one's
}

cudaError_t gemm(const GemmParams& p, cudaStream_t stream) {
  if (p.M == 0) return cudaSuccess;
  if (p.K_x % kXColumnAlign || p.lda % kXColumnAlign || reinterpret_cast<uintptr_t>(p.x) % 16) {
    return cudaErrorMisalignedAddress;
  }
  return with_bits(p.k, cudaErrorInvalidValue, [&](auto bits) {
    constexpr int BITS = decltype(bits)::value;
    return p.ws_tokens ? gemm_ws_for_bits<BITS>(p, stream) : gemm_for_bits<BITS>(p, stream);
  });
}

}  // namespace kbit
