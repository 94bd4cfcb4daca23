// The only file that knows PyTorch: checks tensors, allocates outputs and workspace from the caching
// allocator, and calls the framework-free launchers of kbit.h on the current stream. Registered as
// torch.ops.kbit_cuda.*; kbit/ops.py routes the CUDA dispatch of the kbit:: ops here.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kbit.h"

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

void check_bits(int64_t k) { TORCH_CHECK(k >= 2 && k <= 5, "kbit: k must be 2..5, got ", num(k)); }

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
  const int64_t n = A.numel(), nb = (n + 31) / 32;
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
  const int64_t nb = (n + 31) / 32;
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

// Shapes of the GEMM layout of an [N, K_dim] weight (kbit/layout.py's gemm_shapes).
std::vector<int64_t> layout_codes_shape(int64_t k, int64_t N, int64_t K_dim) {
  return {(N + 255) / 256 * 16, (K_dim + 255) / 256, k, 32, 4};
}
std::vector<int64_t> layout_absmax_shape(int64_t N, int64_t K_dim) {
  return {(N + 255) / 256 * 16, (K_dim + 255) / 256, 2, 8, 8};
}

std::tuple<at::Tensor, at::Tensor> repack(const at::Tensor& packed, const at::Tensor& absmax, int64_t k, int64_t N,
                                          int64_t K_dim) {
  check_bits(k);
  check_dim(N, "N", 1);
  check_dim(K_dim, "K_dim", 32);
  TORCH_CHECK(K_dim % 32 == 0, "kbit: K_dim must be a multiple of 32, got ", num(K_dim));
  TORCH_CHECK(packed.is_cuda(), "kbit: packed must be a CUDA tensor");
  const at::Device on = packed.device();
  const int64_t nb = N * (K_dim / 32);
  check_input(packed, "packed", at::kInt, {nb * k}, on);
  check_input(absmax, "absmax", at::kByte, {nb}, on);
  const c10::cuda::CUDAGuard guard(on);
  // Outputs get their dtype from the layout, never from the inputs' options.
  auto b = at::empty(layout_codes_shape(k, N, K_dim), packed.options().dtype(at::kInt));
  auto a = at::empty(layout_absmax_shape(N, K_dim), packed.options().dtype(at::kByte));
  check_launch(kbit::repack(reinterpret_cast<const uint32_t*>(packed.data_ptr()), absmax.data_ptr<uint8_t>(),
                            static_cast<int>(k), static_cast<int>(N), static_cast<int>(K_dim),
                            reinterpret_cast<uint32_t*>(b.data_ptr()), a.data_ptr<uint8_t>(),
                            c10::cuda::getCurrentCUDAStream()),
               "repack");
  return {b, a};
}

// Split-K workspace: one partial output tile per CTA, every word kbit::kPartialEmpty between GEMMs (the
// kernel restores what it used), so a buffer filled once serves every later GEMM of its stream: no fill
// kernel per call. One buffer per (device, stream), since GEMMs on different streams may overlap. Buffers are
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

// KBIT_GEMM_PATH=ws / classic forces the warp-specialized kernel (compute capability 9.x) / gemm.cuh's; unset or
// anything else lets the planner choose. Read at every call, so a benchmark or tuner can switch it in-process.
kbit::GemmPath gemm_path() {
  const char* v = std::getenv("KBIT_GEMM_PATH");
  if (v == nullptr) return kbit::GemmPath::Auto;
  const std::string s(v);
  return s == "ws" ? kbit::GemmPath::WarpSpecialized : s == "classic" ? kbit::GemmPath::Classic : kbit::GemmPath::Auto;
}

at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& b, const at::Tensor& absmax, const at::Tensor& codebook,
                const at::Tensor& scale, const std::optional<at::Tensor>& bias, int64_t k, int64_t N, int64_t K_w,
                int64_t num_blocks) {
  check_bits(k);
  check_dim(N, "N", 1);
  check_dim(K_w, "K_dim", 32);
  TORCH_CHECK(K_w % 32 == 0, "kbit: K_dim must be a multiple of 32, got ", num(K_w));
  TORCH_CHECK(num_blocks >= 0 && num_blocks <= std::numeric_limits<int>::max(), "kbit: num_blocks must be >= 0");
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2, "kbit: x must be a 2-D CUDA tensor");
  TORCH_CHECK(x_in.scalar_type() == at::kHalf || x_in.scalar_type() == at::kBFloat16, "kbit: x must be fp16 or bf16");
  TORCH_CHECK(x_in.size(1) <= K_w, "kbit: x has ", num(x_in.size(1)), " columns, more than the weight's ", num(K_w));
  check_dim(x_in.size(0), "M (rows of x)", 0);
  const at::Device on = x_in.device();
  check_input(b, "b_gemm", at::kInt, layout_codes_shape(k, N, K_w), on);
  check_input(absmax, "absmax_gemm", at::kByte, layout_absmax_shape(N, K_w), on);
  check_input(codebook, "codebook", at::kFloat, {int64_t{1} << k}, on);
  const float* scale_ptr = scalar_ptr(scale, on);
  if (bias) check_input(*bias, "bias", x_in.scalar_type(), {N}, on);
  const c10::cuda::CUDAGuard guard(on);
  // The kernel reads x in 16-byte pieces: pad the columns to a multiple of 8 and realign if needed.
  at::Tensor x = x_in.contiguous();
  if (x.size(1) % 8) x = at::constant_pad_nd(x, {0, 8 - x.size(1) % 8});
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16) x = x.clone();
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  int sms = 0;
  check_launch(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()), "device query");
  const kbit::GemmPlan plan =
      kbit::gemm_plan(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K_w), static_cast<int>(k), sms,
                      static_cast<int>(num_blocks), gemm_path());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK(plan.smem_limit == 0 || plan.smem_bytes <= plan.smem_limit, "kbit: the fused GEMM at k=", num(k), " needs ",
              num(plan.smem_bytes / 1024), " KB of shared memory per block; this GPU allows ", num(plan.smem_limit / 1024),
              " KB (use dequantize + matmul)");
  TORCH_CHECK(plan.built, "kbit: the fused GEMM at k=", num(k), " for ", num(M), " tokens is not built for this GPU's architecture "
              "(use dequantize + matmul)");

  kbit::GemmParams p{};
  p.x = x.data_ptr();
  p.b = reinterpret_cast<const uint4*>(b.data_ptr());
  p.absmax = absmax.data_ptr<uint8_t>();
  p.codebook = codebook.data_ptr<float>();
  p.scale = scale_ptr;
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.partials = plan.partial_floats > 0 ? split_k_partials(plan.partial_floats, x, stream) : nullptr;
  p.dependent_launch = dependent_launch_enabled() && plan.cc_major >= 9;
  p.M = static_cast<int>(M);
  p.K_x = static_cast<int>(x.size(1));
  p.lda = static_cast<int>(x.size(1));
  p.k = static_cast<int>(k);
  p.dtype = to_dtype(x.scalar_type());
  kbit::gemm_fill_params(p, plan, static_cast<int>(N), static_cast<int>(K_w));
  check_launch(kbit::gemm(p, stream), "gemm");
  return y;
}

}  // namespace

TORCH_LIBRARY(kbit_cuda, m) {
  m.def("quantize(Tensor A, Tensor codebook, int k, Tensor scale) -> (Tensor, Tensor)");
  m.def("dequantize(Tensor packed, Tensor absmax, Tensor codebook, int k, int n, ScalarType dtype, Tensor scale) -> Tensor");
  m.def("repack(Tensor packed, Tensor absmax, int k, int N, int K_dim) -> (Tensor, Tensor)");
  m.def("gemm(Tensor x, Tensor b_gemm, Tensor absmax_gemm, Tensor codebook, Tensor scale, Tensor? bias, int k, int N, "
        "int K_dim, int num_blocks) -> Tensor");
}

TORCH_LIBRARY_IMPL(kbit_cuda, CUDA, m) {
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
  m.impl("repack", &repack);
  m.impl("gemm", &gemm);
}
