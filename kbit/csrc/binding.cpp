// The only file that knows PyTorch: checks tensors, allocates outputs and workspace from the caching
// allocator, and calls the framework-free launchers of kbit.h on the current stream. Registered as
// torch.ops.kbit_cuda.*; kbit/ops.py routes the CUDA dispatch of the kbit:: ops here.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kbit.h"
#include "moe.h"

namespace {

kbit::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return kbit::DType::F16;
    case at::kBFloat16: return kbit::DType::BF16;
    case at::kFloat: return kbit::DType::F32;
    default: TORCH_CHECK(false, "kbit: unsupported dtype ", c10::toString(t));
  }
}

// Error messages format numbers with std::to_string, not through a stream: streaming an integer uses the
// locale's facets, which crash when the extension and libtorch were linked against different libstdc++ builds.
std::string num(int64_t v) { return std::to_string(v); }

std::string shape_string(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Every tensor that reaches a kernel is checked here, whatever Python checked before: a crafted checkpoint
// must never make a kernel read or write out of bounds. on: the device all of an op's tensors must share.
void check_input(const at::Tensor& t, const char* name, at::ScalarType dtype, const std::vector<int64_t>& shape,
                 const at::Device& on) {
  TORCH_CHECK(t.defined(), "kbit: ", name, " is undefined");
  TORCH_CHECK(t.is_cuda() && t.device() == on, "kbit: ", name, " must be on ", on.str(), ", got ", t.device().str());
  TORCH_CHECK(t.scalar_type() == dtype, "kbit: ", name, " must be ", c10::toString(dtype), ", got ",
              c10::toString(t.scalar_type()));
  if (t.sizes() != at::IntArrayRef(shape)) {
    TORCH_CHECK(false, "kbit: ", name, " must have shape ", shape_string(shape), ", got ", shape_string(t.sizes()));
  }
  TORCH_CHECK(t.is_contiguous(), "kbit: ", name, " must be contiguous");
}

void check_bits(int64_t k) {
  TORCH_CHECK(k >= kbit::kMinBits && k <= kbit::kMaxBits, "kbit: k must be ", num(kbit::kMinBits), "..",
              num(kbit::kMaxBits), ", got ", num(k));
}

// The kernels index rows and columns with int: sizes past it are refused, not wrapped.
void check_dim(int64_t v, const char* name, int64_t minimum) {
  TORCH_CHECK(v >= minimum && v <= std::numeric_limits<int>::max(), "kbit: ", name, " must be in [", num(minimum),
              ", ", num(std::numeric_limits<int>::max()), "], got ", num(v));
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "kbit: ", what, " failed: ", cudaGetErrorString(err));
}

// The per-tensor scale: one float32 on the op's device (a 0-dim or one-element tensor).
const float* scalar_ptr(const at::Tensor& scale, const at::Device& on) {
  check_input(scale, "scale", at::kFloat, scale.sizes().vec(), on);
  TORCH_CHECK(scale.numel() == 1, "kbit: scale must hold one float32, got shape ", shape_string(scale.sizes()));
  return scale.data_ptr<float>();
}

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& A, const at::Tensor& codebook, int64_t k,
                                            const at::Tensor& scale) {
  check_bits(k);
  TORCH_CHECK(A.is_cuda(), "kbit: A must be a CUDA tensor");
  const at::Device on = A.device();
  check_input(A, "A", A.scalar_type(), A.sizes().vec(), on);
  to_dtype(A.scalar_type());
  check_input(codebook, "codebook", at::kFloat, {int64_t{1} << k}, on);
  const c10::cuda::CUDAGuard guard(on);
  const int64_t n = A.numel(), nb = (n + kbit::kBlock - 1) / kbit::kBlock;
  auto packed = at::empty({nb * k}, A.options().dtype(at::kInt));
  auto absmax = at::empty({nb}, A.options().dtype(at::kByte));
  check_launch(kbit::quantize(A.data_ptr(), to_dtype(A.scalar_type()), n, codebook.data_ptr<float>(),
                              static_cast<int>(k), scalar_ptr(scale, on), reinterpret_cast<uint32_t*>(packed.data_ptr()),
                              absmax.data_ptr<uint8_t>(), c10::cuda::getCurrentCUDAStream()),
               "quantize");
  return {packed, absmax};
}

at::Tensor dequantize(const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook, int64_t k,
                      int64_t n, at::ScalarType dtype, const at::Tensor& scale) {
  check_bits(k);
  TORCH_CHECK(n >= 0, "kbit: n must be >= 0, got ", num(n));
  to_dtype(dtype);
  TORCH_CHECK(packed.is_cuda(), "kbit: packed must be a CUDA tensor");
  const at::Device on = packed.device();
  const int64_t nb = (n + kbit::kBlock - 1) / kbit::kBlock;
  check_input(packed, "packed", at::kInt, {nb * k}, on);
  check_input(absmax, "absmax", at::kByte, {nb}, on);
  check_input(codebook, "codebook", at::kFloat, {int64_t{1} << k}, on);
  const c10::cuda::CUDAGuard guard(on);
  auto out = at::empty({n}, packed.options().dtype(dtype));
  check_launch(kbit::dequantize(reinterpret_cast<const uint32_t*>(packed.data_ptr()), absmax.data_ptr<uint8_t>(),
                                codebook.data_ptr<float>(), static_cast<int>(k), scalar_ptr(scale, on), n,
                                out.data_ptr(), to_dtype(dtype), c10::cuda::getCurrentCUDAStream()),
               "dequantize");
  return out;
}

// Shapes of the GEMM layout of an [N, in_features_padded] weight (kbit.h, kbit/layout.py's gemm_shapes).
std::vector<int64_t> layout_codes_shape(int64_t k, int64_t N, int64_t in_features_padded) {
  return {kbit::layout_tiles16(N) / kbit::kLayoutBlockTiles, kbit::layout_k_groups(in_features_padded),
          kbit::kLayoutBlockTiles, k, 32, 4};
}
std::vector<int64_t> layout_absmax_shape(int64_t N, int64_t in_features_padded) {
  return {kbit::layout_tiles16(N) / kbit::kLayoutBlockTiles, kbit::layout_k_groups(in_features_padded),
          kbit::kLayoutBlockTiles, 2, 8, 8};
}

// bits and the [N, in_features_padded] weight shape of a storage-format <-> GEMM-layout conversion.
void check_layout_sizes(int64_t k, int64_t N, int64_t in_features_padded) {
  check_bits(k);
  check_dim(N, "N", 1);
  check_dim(in_features_padded, "in_features_padded", kbit::kBlock);
  TORCH_CHECK(in_features_padded % kbit::kBlock == 0, "kbit: in_features_padded must be a multiple of ",
              num(kbit::kBlock), ", got ", num(in_features_padded));
}

std::tuple<at::Tensor, at::Tensor> repack(const at::Tensor& packed, const at::Tensor& absmax, int64_t k, int64_t N,
                                          int64_t in_features_padded) {
  check_layout_sizes(k, N, in_features_padded);
  TORCH_CHECK(packed.is_cuda(), "kbit: packed must be a CUDA tensor");
  const at::Device on = packed.device();
  const int64_t nb = N * (in_features_padded / kbit::kBlock);
  check_input(packed, "packed", at::kInt, {nb * k}, on);
  check_input(absmax, "absmax", at::kByte, {nb}, on);
  const c10::cuda::CUDAGuard guard(on);
  // Outputs get their dtype from the layout, never from the inputs' options.
  auto b = at::empty(layout_codes_shape(k, N, in_features_padded), packed.options().dtype(at::kInt));
  auto a = at::empty(layout_absmax_shape(N, in_features_padded), packed.options().dtype(at::kByte));
  check_launch(kbit::repack(reinterpret_cast<const uint32_t*>(packed.data_ptr()), absmax.data_ptr<uint8_t>(),
                            static_cast<int>(k), static_cast<int>(N), static_cast<int>(in_features_padded),
                            reinterpret_cast<uint32_t*>(b.data_ptr()), a.data_ptr<uint8_t>(),
                            c10::cuda::getCurrentCUDAStream()),
               "repack");
  return {b, a};
}

std::tuple<at::Tensor, at::Tensor> unrepack(const at::Tensor& b_gemm, const at::Tensor& absmax_gemm, int64_t k,
                                            int64_t N, int64_t in_features_padded) {
  check_layout_sizes(k, N, in_features_padded);
  TORCH_CHECK(b_gemm.is_cuda(), "kbit: b_gemm must be a CUDA tensor");
  const at::Device on = b_gemm.device();
  check_input(b_gemm, "b_gemm", at::kInt, layout_codes_shape(k, N, in_features_padded), on);
  check_input(absmax_gemm, "absmax_gemm", at::kByte, layout_absmax_shape(N, in_features_padded), on);
  const c10::cuda::CUDAGuard guard(on);
  const int64_t nb = N * (in_features_padded / kbit::kBlock);
  auto packed = at::empty({nb * k}, b_gemm.options().dtype(at::kInt));
  auto absmax = at::empty({nb}, b_gemm.options().dtype(at::kByte));
  check_launch(kbit::unrepack(reinterpret_cast<const uint32_t*>(b_gemm.data_ptr()), absmax_gemm.data_ptr<uint8_t>(),
                              static_cast<int>(k), static_cast<int>(N), static_cast<int>(in_features_padded),
                              reinterpret_cast<uint32_t*>(packed.data_ptr()), absmax.data_ptr<uint8_t>(),
                              c10::cuda::getCurrentCUDAStream()),
               "unrepack");
  return {packed, absmax};
}

// The dense [N, in_features_padded] weight in `dtype` from the GEMM layout: dequantize(unrepack(...)) in one pass.
at::Tensor dequantize_layout(const at::Tensor& b_gemm, const at::Tensor& absmax_gemm, const at::Tensor& codebook,
                             int64_t k, int64_t N, int64_t in_features_padded, at::ScalarType dtype,
                             const at::Tensor& scale) {
  check_layout_sizes(k, N, in_features_padded);
  to_dtype(dtype);
  TORCH_CHECK(b_gemm.is_cuda(), "kbit: b_gemm must be a CUDA tensor");
  const at::Device on = b_gemm.device();
  check_input(b_gemm, "b_gemm", at::kInt, layout_codes_shape(k, N, in_features_padded), on);
  check_input(absmax_gemm, "absmax_gemm", at::kByte, layout_absmax_shape(N, in_features_padded), on);
  check_input(codebook, "codebook", at::kFloat, {int64_t{1} << k}, on);
  const c10::cuda::CUDAGuard guard(on);
  auto out = at::empty({N, in_features_padded}, b_gemm.options().dtype(dtype));
  check_launch(kbit::dequantize_layout(reinterpret_cast<const uint32_t*>(b_gemm.data_ptr()),
                                       absmax_gemm.data_ptr<uint8_t>(), codebook.data_ptr<float>(),
                                       static_cast<int>(k), scalar_ptr(scale, on), static_cast<int>(N),
                                       static_cast<int>(in_features_padded), out.data_ptr(), to_dtype(dtype),
                                       c10::cuda::getCurrentCUDAStream()),
               "dequantize_layout");
  return out;
}

// Split-K workspace: the CTAs' partial output tiles (GemmPlan::partial_floats), every word kbit::kPartialEmpty
// between GEMMs (the kernel restores what it used), so a buffer filled once serves every later GEMM of its stream:
// no fill kernel per call. One buffer per (device, stream), since GEMMs on different streams may overlap. Buffers are
// kept for the life of the process (a captured CUDA graph holds their address); a larger need adds a larger
// one. They come from cudaMalloc, not the caching allocator: during the warm-up runs of torch.compile's CUDA
// graph trees the caching allocator hands out the graph's private pool, where a buffer kept past the call is
// an untracked live tensor. A stream under capture with no buffer large enough gets a filled one for that call
// only, from the graph's pool: a buffer first filled inside a graph is not filled until the graph runs.
float* split_k_partials(int64_t n, const at::Tensor& like, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_launch(cudaStreamIsCapturing(stream, &capture), "stream capture query");
  struct Workspace {
    float* words;
    int64_t floats;
  };
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, std::vector<Workspace>> buffers;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& list = buffers[{like.get_device(), stream}];
  if (!list.empty() && list.back().floats >= n) return list.back().words;
  const int64_t floats = std::max<int64_t>(n, 1 << 16);
  const auto words = like.options().dtype(at::kInt);
  if (capture != cudaStreamCaptureStatusNone) {
    // Under capture, the graph's memory pool keeps this allocation for the graph, as for any workspace.
    return reinterpret_cast<float*>(at::full({floats}, static_cast<int32_t>(kbit::kPartialEmpty), words).data_ptr());
  }
  void* memory = nullptr;
  check_launch(cudaMalloc(&memory, floats * sizeof(float)), "split-K workspace allocation");
  at::from_blob(memory, {floats}, words).fill_(static_cast<int32_t>(kbit::kPartialEmpty));
  list.push_back({static_cast<float*>(memory), floats});
  return list.back().words;
}

// Programmatic dependent launch of the GEMM (sm_90, see common.cuh); KBIT_DEPENDENT_LAUNCH=0 turns it off.
bool dependent_launch_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("KBIT_DEPENDENT_LAUNCH");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

// ClusterUse from KBIT_WS_CLUSTERS, read at every call (a benchmark compares both sums in one process).
kbit::ClusterUse ws_cluster_use() {
  const char* v = std::getenv("KBIT_WS_CLUSTERS");
  const std::string use = v == nullptr ? "" : v;
  return use == "0"   ? kbit::ClusterUse::kL2
         : use == "1" ? kbit::ClusterUse::kRequired
                      : kbit::ClusterUse::kWhereTheyFit;
}

// The parameters the single and the grouped GEMM fill alike (GroupedGemmParams extends GemmParams).
void fill_gemm_inputs(kbit::GemmParams& p, const at::Tensor& x, const at::Tensor& b, const at::Tensor& absmax,
                      const at::Tensor& codebook, const float* scale, const at::Tensor& y, const kbit::GemmPlan& plan,
                      int64_t M, int64_t k, bool weights_settled, cudaStream_t stream) {
  p.x = x.data_ptr();
  p.b = reinterpret_cast<const uint4*>(b.data_ptr());
  p.absmax = absmax.data_ptr<uint8_t>();
  p.codebook = codebook.data_ptr<float>();
  p.scale = scale;
  p.y = y.data_ptr();
  p.partials = plan.partial_floats > 0 ? split_k_partials(plan.partial_floats, x, stream) : nullptr;
  p.dependent_launch = dependent_launch_enabled() && plan.cc_major >= 9;
  p.weights_settled = weights_settled;
  p.M = static_cast<int>(M);
  p.K_x = static_cast<int>(x.size(1));
  p.lda = static_cast<int>(x.size(1));
  p.k = static_cast<uint8_t>(k);
  p.dtype = to_dtype(x.scalar_type());
}

// Out-of-range launch numbers stay out of range (and are refused) instead of wrapping.
int clamp_to_int(int64_t v) {
  return static_cast<int>(std::max<int64_t>(-1, std::min<int64_t>(v, std::numeric_limits<int>::max())));
}

at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& b, const at::Tensor& absmax, const at::Tensor& codebook,
                const at::Tensor& scale, const std::optional<at::Tensor>& bias, int64_t k, int64_t N,
                int64_t in_features_padded, int64_t grid, int64_t tile_parts, bool whole_tiles, int64_t mb,
                int64_t wgmma_tiles, int64_t k_split, int64_t ws_tokens, bool weights_settled) {
  check_bits(k);
  check_dim(N, "N", 1);
  check_dim(in_features_padded, "in_features_padded", kbit::kBlock);
  TORCH_CHECK(in_features_padded % kbit::kBlock == 0, "kbit: in_features_padded must be a multiple of ",
              num(kbit::kBlock), ", got ", num(in_features_padded));
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2, "kbit: x must be a 2-D CUDA tensor");
  TORCH_CHECK(x_in.scalar_type() == at::kHalf || x_in.scalar_type() == at::kBFloat16, "kbit: x must be fp16 or bf16");
  TORCH_CHECK(x_in.size(1) <= in_features_padded, "kbit: x has ", num(x_in.size(1)),
              " columns, more than the weight's ", num(in_features_padded));
  check_dim(x_in.size(0), "M (rows of x)", 0);
  const at::Device on = x_in.device();
  check_input(b, "b_gemm", at::kInt, layout_codes_shape(k, N, in_features_padded), on);
  check_input(absmax, "absmax_gemm", at::kByte, layout_absmax_shape(N, in_features_padded), on);
  check_input(codebook, "codebook", at::kFloat, {int64_t{1} << k}, on);
  // One float32 for the whole weight, or one per 256 output rows (sibling projections fused: kbit/fusion.py).
  const int64_t row_blocks = (N + kbit::kLayoutNAlign - 1) / kbit::kLayoutNAlign;
  const bool row_scales = scale.numel() != 1;
  TORCH_CHECK(!row_scales || scale.dim() == 1, "kbit: scale must hold one float32 or one per 256 output rows (",
              num(row_blocks), "), got shape ", shape_string(scale.sizes()));
  if (row_scales) check_input(scale, "scale", at::kFloat, {row_blocks}, on);
  const float* scale_ptr = row_scales ? scale.data_ptr<float>() : scalar_ptr(scale, on);
  if (bias) check_input(*bias, "bias", x_in.scalar_type(), {N}, on);
  const c10::cuda::CUDAGuard guard(on);
  // The kernel reads x in 16-byte pieces: pad the columns to a multiple of kXColumnAlign and realign if needed.
  at::Tensor x = x_in.contiguous();
  const int64_t short_by = (kbit::kXColumnAlign - x.size(1) % kbit::kXColumnAlign) % kbit::kXColumnAlign;
  if (short_by) x = at::constant_pad_nd(x, {0, short_by});
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16) x = x.clone();
  const int64_t M = x.size(0);
  int sms = 0;
  check_launch(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()), "device query");
  // The configuration and its launch are kbit/planner.py's choice; refuse one that is not built, that this GPU
  // cannot run, or a launch that does not fit it.
  const std::string config = "k=" + num(k) + ", mb=" + num(mb) + ", wgmma_tiles=" + num(wgmma_tiles) +
                             ", k_split=" + num(k_split) + ", ws_tokens=" + num(ws_tokens);
  kbit::GemmConfigInfo info{};
  TORCH_CHECK(mb >= 1 && mb <= 32 && wgmma_tiles >= 0 && wgmma_tiles <= 2 && k_split >= 1 && k_split <= 8 &&
                  ws_tokens >= 0 && ws_tokens <= 256 &&
                  kbit::gemm_config_info(static_cast<int>(k), static_cast<int>(mb), static_cast<int>(wgmma_tiles),
                                         static_cast<int>(k_split), static_cast<int>(ws_tokens), &info),
              "kbit: the fused GEMM has no configuration ", config);
  const kbit::GemmPlan plan =
      kbit::gemm_plan(static_cast<int>(M), static_cast<int>(N), static_cast<int>(in_features_padded),
                      static_cast<int>(k),
                      static_cast<int>(mb), static_cast<int>(wgmma_tiles), static_cast<int>(k_split),
                      static_cast<int>(ws_tokens),
                      kbit::GemmLaunch{clamp_to_int(grid), clamp_to_int(tile_parts), whole_tiles},
                      sms);
  TORCH_CHECK(plan.built, "kbit: the fused GEMM configuration ", config, " is not built for compute capability ",
              num(plan.cc_major), ".x (use dequantize + matmul)");
  TORCH_CHECK(plan.smem_limit == 0 || plan.smem_bytes <= plan.smem_limit, "kbit: the fused GEMM configuration ",
              config, " needs ", num(plan.smem_bytes / 1024), " KB of shared memory per block; this GPU allows ",
              num(plan.smem_limit / 1024), " KB (use dequantize + matmul)");
  TORCH_CHECK(plan.refused == nullptr, "kbit: the launch grid=", num(grid), ", tile_parts=", num(tile_parts),
              ", whole_tiles=", whole_tiles ? "true" : "false", " of the fused GEMM configuration ", config, " for M=",
              num(M), ", N=", num(N), ", in_features_padded=", num(in_features_padded), " on ", num(sms), " SMs: it ", plan.refused);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  kbit::GemmParams p{};
  fill_gemm_inputs(p, x, b, absmax, codebook, scale_ptr, y, plan, M, k, weights_settled, stream);
  p.row_scales = row_scales;
  p.bias = bias ? bias->data_ptr() : nullptr;
  kbit::gemm_fill_params(p, plan, static_cast<int>(N), static_cast<int>(in_features_padded));
  p.grid_room = 2 * plan.grid <= sms ? kbit::GridRoom::kHalfOrLess
              : plan.grid < sms    ? kbit::GridRoom::kBelowSms
                                   : kbit::GridRoom::kFull;
  if (ws_tokens > 0) p.clusters = ws_cluster_use();  // the environment read where it counts
  const cudaError_t err = kbit::gemm(p, stream);
  TORCH_CHECK(err != cudaErrorInvalidClusterSize, "kbit: the launch grid=", num(grid), ", tile_parts=", num(tile_parts),
              " of the fused GEMM configuration ", config, ": this GPU cannot run its thread-block clusters of ",
              num(tile_parts), " CTAs (with the warp-specialized kernel and KBIT_WS_CLUSTERS=1: all at once)");
  check_launch(err, "gemm");
  return y;
}

// Every built configuration of the fused GEMM as JSON (kbit/planner.py plans from it), and the device facts the
// binding checks a configuration against.
std::string gemm_configs() {
  std::string json = "[";
  for (const kbit::GemmConfigInfo& c : kbit::gemm_configs()) {
    json += std::string(json.size() > 1 ? ", " : "") + "{\"bits\": " + num(c.bits) + ", \"mb\": " + num(c.mb) +
            ", \"wgmma_tiles\": " + num(c.wgmma_tiles) + ", \"k_split\": " + num(c.k_split) +
            ", \"ws_tokens\": " + num(c.ws_tokens) + ", \"tile_rows\": " + num(c.tile_rows) +
            ", \"smem_bytes\": " + num(c.smem_bytes) + ", \"cc_major_min\": " + num(c.cc_major_min) +
            ", \"cc_major_max\": " + num(c.cc_major_max) + "}";
  }
  return json + "]";
}

int64_t shared_memory_per_block_optin(int64_t device) {
  int bytes = 0;
  check_launch(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, static_cast<int>(device)),
               "device query");
  return bytes;
}

// Clusters of `ctas` CTAs of gemm.cuh's clustered kernels the device runs at once (kbit/planner.py: Device.clusters).
int64_t gemm_clusters_at_once(int64_t device, int64_t ctas) {
  TORCH_CHECK(ctas >= 1 && ctas <= 8, "kbit: gemm_clusters_at_once: ctas must be 1..8, got ", num(ctas));
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return kbit::gemm_clusters_at_once(static_cast<int>(ctas));
}

// ---------------------------------------------------------------------------- mixture of experts (moe.h)
void check_rows_per_pass(int64_t rows) {
  std::string built;
  for (const int r : kbit::kGroupedRowsPerPass) {
    if (rows == r) return;
    built += (built.empty() ? "" : ", ") + num(r);
  }
  TORCH_CHECK(false, "kbit: rows_per_pass must be one of ", built, ", got ", num(rows));
}

void check_num_experts(int64_t E) {
  TORCH_CHECK(E >= 1 && E <= kbit::kMaxGroupedExperts, "kbit: the number of experts must be in [1, ",
              num(kbit::kMaxGroupedExperts), "], got ", num(E));
}

// The rows per pass the grouped GEMM runs on the current device at k bits: built for its architecture and within
// its shared memory (kbit/moe.py picks among them; on sm_80-class GPUs some configurations do not fit).
std::vector<int64_t> moe_rows_per_pass_supported(int64_t k) {
  check_bits(k);
  int device = 0, sms = 0;
  check_launch(cudaGetDevice(&device), "device query");
  check_launch(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "device query");
  std::vector<int64_t> rows;
  for (const int r : kbit::kGroupedRowsPerPass) {
    const kbit::GemmPlan plan = kbit::grouped_gemm_plan(r, static_cast<int>(k), sms, 0);
    if (plan.built && (plan.smem_limit == 0 || plan.smem_bytes <= plan.smem_limit)) rows.push_back(r);
  }
  return rows;
}

std::vector<int64_t> stacked(int64_t experts, std::vector<int64_t> shape) {
  shape.insert(shape.begin(), experts);
  return shape;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route(const at::Tensor& expert_ids,
                                                                                 const at::Tensor& weights,
                                                                                 int64_t num_experts,
                                                                                 int64_t rows_per_pass) {
  TORCH_CHECK(expert_ids.is_cuda() && expert_ids.dim() == 2, "kbit: expert_ids must be a 2-D CUDA tensor [tokens, top_k]");
  const at::Device on = expert_ids.device();
  const bool ids_64 = expert_ids.scalar_type() == at::kLong;
  TORCH_CHECK(ids_64 || expert_ids.scalar_type() == at::kInt, "kbit: expert_ids must be int64 or int32, got ",
              c10::toString(expert_ids.scalar_type()));
  check_input(expert_ids, "expert_ids", expert_ids.scalar_type(), expert_ids.sizes().vec(), on);
  check_input(weights, "weights", weights.scalar_type(), expert_ids.sizes().vec(), on);
  const kbit::DType weights_dtype = to_dtype(weights.scalar_type());
  check_num_experts(num_experts);
  check_rows_per_pass(rows_per_pass);
  const int64_t tokens = expert_ids.size(0), top_k = expert_ids.size(1), slots = tokens * top_k;
  check_dim(top_k, "top_k", 1);
  check_dim(slots, "tokens * top_k", 0);
  const int64_t max_passes = std::min(num_experts, slots) + slots / rows_per_pass;
  const c10::cuda::CUDAGuard guard(on);
  const auto i32 = expert_ids.options().dtype(at::kInt);
  auto x_rows = at::empty({slots}, i32);
  auto row_weights = at::empty({slots}, expert_ids.options().dtype(at::kFloat));
  auto position = at::empty({tokens, top_k}, i32);
  auto passes = at::empty({max_passes, 4}, i32);
  auto num_passes = at::empty({1}, i32);
  if (slots == 0) {
    num_passes.zero_();
    return {x_rows, row_weights, position, passes, num_passes};
  }
  check_launch(kbit::moe_route(expert_ids.data_ptr(), ids_64, weights.data_ptr(), weights_dtype, static_cast<int>(slots),
                               static_cast<int>(top_k), static_cast<int>(num_experts), static_cast<int>(rows_per_pass),
                               static_cast<int>(max_passes), x_rows.data_ptr<int>(), row_weights.data_ptr<float>(),
                               position.data_ptr<int>(), reinterpret_cast<int4*>(passes.data_ptr()),
                               num_passes.data_ptr<int>(), c10::cuda::getCurrentCUDAStream()),
               "moe_route");
  return {x_rows, row_weights, position, passes, num_passes};
}

at::Tensor moe_gemm(const at::Tensor& x, const at::Tensor& b, const at::Tensor& absmax, const at::Tensor& codebook,
                    const at::Tensor& scale, const std::optional<at::Tensor>& x_rows,
                    const std::optional<at::Tensor>& row_weights, const at::Tensor& passes,
                    const at::Tensor& num_passes, int64_t k, int64_t N, int64_t in_features_padded,
                    int64_t rows_per_pass,
                    bool silu_gate, int64_t grid_override, bool weights_settled) {
  check_bits(k);
  check_dim(N, "N", 1);
  check_dim(in_features_padded, "in_features_padded", kbit::kBlock);
  TORCH_CHECK(in_features_padded % kbit::kBlock == 0, "kbit: in_features_padded must be a multiple of ",
              num(kbit::kBlock), ", got ", num(in_features_padded));
  check_rows_per_pass(rows_per_pass);
  TORCH_CHECK(grid_override >= 0 && grid_override <= std::numeric_limits<int>::max(),
              "kbit: grid_override must be >= 0");
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, "kbit: x must be a 2-D CUDA tensor");
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "kbit: x must be fp16 or bf16");
  const at::Device on = x.device();
  check_input(x, "x", x.scalar_type(), x.sizes().vec(), on);
  TORCH_CHECK(x.size(1) % kbit::kXColumnAlign == 0 && x.size(1) <= in_features_padded,
              "kbit: x must have a multiple of ",
              num(kbit::kXColumnAlign), " columns, at most in_features_padded = ",
              num(in_features_padded), ", got ", num(x.size(1)));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "kbit: x must be 16-byte aligned");
  check_dim(x.size(0), "rows of x", 0);
  TORCH_CHECK(b.dim() == 7, "kbit: b_gemm must be the experts' GEMM layouts stacked [experts, ...], got shape ",
              shape_string(b.sizes()));
  const int64_t E = b.size(0);
  check_num_experts(E);
  check_input(b, "b_gemm", at::kInt, stacked(E, layout_codes_shape(k, N, in_features_padded)), on);
  check_input(absmax, "absmax_gemm", at::kByte, stacked(E, layout_absmax_shape(N, in_features_padded)), on);
  check_input(codebook, "codebook", at::kFloat, {int64_t{1} << k}, on);
  check_input(scale, "scale", at::kFloat, {E}, on);
  if (x_rows) {
    TORCH_CHECK(x_rows->dim() == 1, "kbit: x_rows must be 1-D, got shape ", shape_string(x_rows->sizes()));
    check_input(*x_rows, "x_rows", at::kInt, {x_rows->size(0)}, on);
  }
  const int64_t M = x_rows ? x_rows->size(0) : x.size(0);
  check_dim(M, "rows of y", 0);
  TORCH_CHECK(M == 0 || x.size(0) > 0, "kbit: x has no rows for x_rows to select");
  if (row_weights) check_input(*row_weights, "row_weights", at::kFloat, {M}, on);
  TORCH_CHECK(!(silu_gate && row_weights), "kbit: row_weights apply to the plain epilogue, not silu_gate");
  TORCH_CHECK(!silu_gate || N % 16 == 0, "kbit: silu_gate needs N (gate and up rows) a multiple of 16, got ", num(N));
  TORCH_CHECK(passes.dim() == 2, "kbit: passes must be [max_passes, 4], got shape ", shape_string(passes.sizes()));
  check_input(passes, "passes", at::kInt, {passes.size(0), 4}, on);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(passes.data_ptr()) % 16 == 0, "kbit: passes must be 16-byte aligned");
  check_input(num_passes, "num_passes", at::kInt, {1}, on);
  const int64_t P = passes.size(0);
  // Steps are ints on the device: passes x CTA row tiles (128 rows at the fewest) x k-groups.
  TORCH_CHECK(P * ((N + 127) / 128) * ((in_features_padded + 255) / 256) <= std::numeric_limits<int>::max(),
              "kbit: too many passes for one grouped GEMM: ", num(P));
  const c10::cuda::CUDAGuard guard(on);
  auto y = at::empty({M, silu_gate ? N / 2 : N}, x.options());
  if (M == 0 || P == 0) return y;
  int sms = 0;
  check_launch(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()), "device query");
  const kbit::GemmPlan plan = kbit::grouped_gemm_plan(static_cast<int>(rows_per_pass), static_cast<int>(k), sms,
                                                      static_cast<int>(grid_override));
  TORCH_CHECK(plan.smem_limit == 0 || plan.smem_bytes <= plan.smem_limit, "kbit: the grouped GEMM at k=", num(k),
              " with ", num(rows_per_pass), " rows per pass needs ", num(plan.smem_bytes / 1024),
              " KB of shared memory per block; this GPU allows ", num(plan.smem_limit / 1024), " KB");
  TORCH_CHECK(plan.built, "kbit: the grouped GEMM at k=", num(k), " with ", num(rows_per_pass),
              " rows per pass is not built for this GPU's architecture");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  kbit::GroupedGemmParams p{};
  fill_gemm_inputs(p, x, b, absmax, codebook, scale.data_ptr<float>(), y, plan, M, k, weights_settled, stream);
  kbit::grouped_gemm_fill_params(p, plan, static_cast<int>(N), static_cast<int>(in_features_padded));
  p.passes = reinterpret_cast<const int4*>(passes.data_ptr());
  p.num_passes = num_passes.data_ptr<int>();
  p.x_rows = x_rows ? x_rows->data_ptr<int>() : nullptr;
  p.row_weights = row_weights ? row_weights->data_ptr<float>() : nullptr;
  p.max_passes = static_cast<int>(P);
  p.num_experts = static_cast<int>(E);
  p.x_count = static_cast<int>(x.size(0));
  p.epilogue = silu_gate ? kbit::GroupedEpilogue::SiluGate : kbit::GroupedEpilogue::Store;
  check_launch(kbit::grouped_gemm(p, stream), "moe_gemm");
  return y;
}

at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& position) {
  TORCH_CHECK(y.is_cuda() && y.dim() == 2, "kbit: y must be a 2-D CUDA tensor");
  TORCH_CHECK(y.scalar_type() == at::kHalf || y.scalar_type() == at::kBFloat16, "kbit: y must be fp16 or bf16");
  const at::Device on = y.device();
  check_input(y, "y", y.scalar_type(), y.sizes().vec(), on);
  TORCH_CHECK(y.size(1) % 8 == 0, "kbit: y must have a multiple of 8 columns, got ", num(y.size(1)));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0, "kbit: y must be 16-byte aligned");
  check_dim(y.size(0), "rows of y", 0);
  check_dim(y.size(1), "columns of y", 0);
  TORCH_CHECK(position.dim() == 2, "kbit: position must be [tokens, top_k], got shape ", shape_string(position.sizes()));
  check_input(position, "position", at::kInt, position.sizes().vec(), on);
  check_dim(position.size(0), "tokens", 0);
  check_dim(position.numel(), "tokens * top_k", 0);
  const c10::cuda::CUDAGuard guard(on);
  auto out = at::empty({position.size(0), y.size(1)}, y.options());
  check_launch(kbit::moe_combine(y.data_ptr(), static_cast<int>(y.size(0)), position.data_ptr<int>(),
                                 static_cast<int>(position.size(0)), static_cast<int>(position.size(1)),
                                 static_cast<int>(y.size(1)), out.data_ptr(), to_dtype(y.scalar_type()),
                                 c10::cuda::getCurrentCUDAStream()),
               "moe_combine");
  return out;
}

}  // namespace

TORCH_LIBRARY(kbit_cuda, m) {
  m.def("quantize(Tensor A, Tensor codebook, int k, Tensor scale) -> (Tensor, Tensor)");
  m.def("dequantize(Tensor packed, Tensor absmax, Tensor codebook, int k, int n, ScalarType dtype, Tensor scale) -> Tensor");
  m.def("repack(Tensor packed, Tensor absmax, int k, int N, int in_features_padded) -> (Tensor, Tensor)");
  m.def("unrepack(Tensor b_gemm, Tensor absmax_gemm, int k, int N, int in_features_padded) -> (Tensor, Tensor)");
  m.def("dequantize_layout(Tensor b_gemm, Tensor absmax_gemm, Tensor codebook, int k, int N, int in_features_padded, "
        "ScalarType dtype, Tensor scale) -> Tensor");
  m.def("gemm(Tensor x, Tensor b_gemm, Tensor absmax_gemm, Tensor codebook, Tensor scale, Tensor? bias, int k, int N, "
        "int in_features_padded, int grid, int tile_parts, bool whole_tiles, int mb, int wgmma_tiles, int k_split, "
        "int ws_tokens, "
        "bool weights_settled) -> Tensor");
  m.def("gemm_configs() -> str", &gemm_configs);  // no tensors: any backend
  m.def("shared_memory_per_block_optin(int device) -> int", &shared_memory_per_block_optin);
  m.def("gemm_clusters_at_once(int device, int ctas) -> int", &gemm_clusters_at_once);
  m.def("moe_route(Tensor expert_ids, Tensor weights, int num_experts, int rows_per_pass) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_gemm(Tensor x, Tensor b_gemm, Tensor absmax_gemm, Tensor codebook, Tensor scale, Tensor? x_rows, "
        "Tensor? row_weights, Tensor passes, Tensor num_passes, int k, int N, int in_features_padded, "
        "int rows_per_pass, bool silu_gate, int grid_override, bool weights_settled) -> Tensor");
  m.def("moe_combine(Tensor y, Tensor position) -> Tensor");
  m.def("moe_rows_per_pass_supported(int k) -> int[]", &moe_rows_per_pass_supported);  // no tensors: any backend
}

TORCH_LIBRARY_IMPL(kbit_cuda, CUDA, m) {
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
  m.impl("repack", &repack);
  m.impl("unrepack", &unrepack);
  m.impl("dequantize_layout", &dequantize_layout);
  m.impl("gemm", &gemm);
  m.impl("moe_route", &moe_route);
  m.impl("moe_gemm", &moe_gemm);
  m.impl("moe_combine", &moe_combine);
}
