// Device helpers shared by the kbit kernels. Each exists because two or more kernels need the same
// bit-exact behaviour as the Python reference (kbit/formats.py) or the same PTX wrapper.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "kbit.h"

namespace kbit {

// ---------------------------------------------------------------------------- host: per-device launch setup
// A kernel's dynamic shared memory limit is an attribute set per device, and the bytes a launch needs depend on
// the device's reserved shared memory: Setup(bytes) runs once per device ordinal (the current device at the
// call), and later launches on that device reuse its result.
constexpr int kMaxDevices = 64;
template <cudaError_t (*Setup)(int&)>
cudaError_t setup_once_per_device(int& bytes) {
  static std::once_flag once[kMaxDevices];
  static int device_bytes[kMaxDevices];
  static cudaError_t device_result[kMaxDevices];
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  std::call_once(once[device], [device] { device_result[device] = Setup(device_bytes[device]); });
  bytes = device_bytes[device];
  return device_result[device];
}

// Where a kernel's dynamic shared memory starts on the current device: after the per-block reserve and the kernel's
// static shared memory (the Setup functions size the dynamic part from it).
template <typename Kernel>
cudaError_t dynamic_smem_base(Kernel* kernel, int& base) {
  cudaFuncAttributes attr{};
  int device = 0, reserved = 0;
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err == cudaSuccess) err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device);
  if (err == cudaSuccess) base = reserved + static_cast<int>(attr.sharedSizeBytes);
  return err;
}

// E4M4 decode: exponent bias 11, subnormals when the exponent field is 0 (value m * 2^-14).
__device__ __forceinline__ float decode_e4m4(uint32_t c) {
  const uint32_t e = c >> 4, m = c & 15u;
  return e == 0 ? static_cast<float>(m) * 0x1p-14f : __uint_as_float(((e + 116u) << 23) | (m << 19));
}

// decode_e4m4 of byte b of `word`, in three ALU instructions and no table: the code placed at bits 19..26
// is a float whose exponent field is E and whose mantissa starts with M, i.e. exactly 2^-116 times the
// E4M4 value, subnormals included (E = 0 is a float denormal, M * 2^-130); one multiply rebiases it.
// Needs denormals kept (the kernels are not built with flush-to-zero).
__device__ __forceinline__ float e4m4_byte_to_float(uint32_t word, int b) {
  const uint32_t at_bit_16 = __byte_perm(word, 0u, 0x4044u | (b << 8));  // byte b at bits 16..23, zeros else
  return __uint_as_float(at_bit_16 << 3) * 0x1p116f;
}

// Bytes b and b + 1 of `word` (E4M4 codes) as two 16-bit T values in one register (byte b low), each decode_e4m4's
// value times kE4M4PairUnit<T>, in two instructions: a code shifted so that its 4 exponent bits land at the low end
// of T's exponent field and its mantissa at the top of T's is exactly the E4M4 value times 2^(11 - T's bias),
// subnormals included (E = 0 is a T subnormal): fp16 (bias 15) at bits 6..13, 1/16; bf16 (bias 127) at bits 3..10,
// 2^-116. One PRMT places both codes, one shift both. b is 0 or 2.
template <typename T>
constexpr float kE4M4PairUnit = std::is_same<T, __half>::value ? 0x1p-4f : 0x1p-116f;
template <typename T>
__device__ __forceinline__ uint32_t e4m4_pair_bits(uint32_t word, int b) {
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value, "16-bit element types only");
  return __byte_perm(word, 0u, 0x4040u | b | ((b + 1) << 8)) << (std::is_same<T, __half>::value ? 6 : 3);
}
// The same two codes as floats, each 1/16 of decode_e4m4's value, in four instructions for the two
// (e4m4_byte_to_float takes three for one): the fp16 pair, converted exactly.
__device__ __forceinline__ float2 e4m4_pair_to_float_sixteenths(uint32_t word, int b) {
  const uint32_t bits = e4m4_pair_bits<__half>(word, b);
  const __half2 halves = *reinterpret_cast<const __half2*>(&bits);
  return make_float2(__low2float(halves), __high2float(halves));
}

// E4M4 encode of a non-negative float: round to nearest even on the float's bit pattern, saturating at 0xFF
// (31.0; infinities and NaN also give 0xFF). Branch-free; mirrors formats.encode_absmax_e4m4 exactly.
__device__ __forceinline__ uint32_t encode_e4m4(float x) {
  const uint32_t bits = __float_as_uint(x);
  // Exponent and the top 4 mantissa bits, the other 19 rounded half-to-even (a carry bumps the exponent).
  const uint32_t rounded = (bits + 0x3FFFFu + ((bits >> 19) & 1u)) >> 19;
  const uint32_t normal = min(rounded - (116u << 4), 0xFFu);  // E4M4 exponent = float exponent - 116
  const uint32_t subnormal = static_cast<uint32_t>(rintf(x * 16384.0f));  // x < 2^-10: code = x / 2^-14
  return (bits >> 23) < 117u ? subnormal : normal;
}

// Scalar conversions between the three element types and float.
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Two floats rounded to the GEMM's 16-bit type and packed into one 32-bit MMA operand register
// (lo in the low half): the pair table's entries.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  static_assert(sizeof(T) == 2, "16-bit element types only");
  const T l = from_float<T>(lo), h = from_float<T>(hi);
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&l)) |
         static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&h)) << 16;
}

// Two 16-bit values times a packed pair of 16-bit scales, rounded once. bf16 on sm_80 (no bf16 multiply before
// sm_90): a fused multiply-add of -0, which leaves every product (signed zeros included) as the multiply would.
template <typename T>
__device__ __forceinline__ uint32_t mul_pair(uint32_t v, uint32_t s) {
  uint32_t r;
  if constexpr (std::is_same<T, __half>::value) {
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(v), "r"(s));
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(v), "r"(s), "r"(0x80008000u));
#else
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(v), "r"(s));
#endif
  }
  return r;
}
template <typename T>
__device__ __forceinline__ uint32_t splat_pair(float v) {
  uint32_t r;
  if constexpr (std::is_same<T, __half>::value) asm("cvt.rn.f16x2.f32 %0, %1, %1;\n" : "=r"(r) : "f"(v));
  else asm("cvt.rn.bf16x2.f32 %0, %1, %1;\n" : "=r"(r) : "f"(v));
  return r;
}
// Half i (0: low) of a packed pair in both halves. As moves of the halves, which ptxas folds into the operand
// selector of the instruction that reads the result (HMUL2 R, R, R.H0_H0): no instruction of its own, where a PRMT
// stayed one.
__device__ __forceinline__ uint32_t splat_half(uint32_t pair, int i) {
  uint32_t r;
  if (i == 0) asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tmov.b32 %0, {l, l};\n\t}\n" : "=r"(r) : "r"(pair));
  else asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tmov.b32 %0, {h, h};\n\t}\n" : "=r"(r) : "r"(pair));
  return r;
}

// ---------------------------------------------------------------------------- the GEMM layout's pairs
// (a & mask) | (b & ~mask) in one LOP3. Inline PTX: as C++ the compiler re-associates a gather of three words' bits
// into a separate extraction per pair, ~6 instructions per pair instead of ~1.
__device__ __forceinline__ uint32_t bit_select(uint32_t mask, uint32_t a, uint32_t b) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xCA;" : "=r"(r) : "r"(mask), "r"(a), "r"(b));
  return r;
}

// BITS = 3, 4: the word whose byte pair % 4 holds pair `pair` in its low 2 * BITS bits (layout.py, pair_bit_offset).
// BITS = 4: word pair / 4. BITS = 3: word 3u + s of the two-block triple u = pair / 16 (s = pair / 4 % 4), or for s = 3
// the triple's top bits gathered: byte i's bits 0-1, 2-3, 4-5 from bits 6-7 of byte i of words 3u, 3u + 1, 3u + 2
// (two bit_selects over three shifts; bits 6-7 are the next byte's, which the table ignores). The loops
// calling this are unrolled and the words unchanged between calls, so the gather is computed once per triple.
template <int BITS>
__device__ __forceinline__ uint32_t byte_pair_word(const uint32_t (&w)[4 * BITS], int pair) {
  static_assert(BITS == 3 || BITS == 4, "pairs byte-aligned at BITS = 3 and 4 only");
  if constexpr (BITS == 4) {
    return w[pair / 4];
  } else {
    const int u = pair / 16, s = pair / 4 % 4;
    if (s < 3) return w[3 * u + s];
    return bit_select(0x0F0F0F0Fu, bit_select(0x03030303u, w[3 * u] >> 6, w[3 * u + 1] >> 4), w[3 * u + 2] >> 2);
  }
}

// ---------------------------------------------------------------------------- async copies
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16-byte global -> shared copy through L2 only; src_bytes = 0 zero-fills the destination.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(smem)), "l"(gmem), "r"(src_bytes));
}
// 4-byte global -> shared copy (through L1: the four copies of one 16-byte chunk hit one line); src_bytes = 0
// zero-fills the destination.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes = 4) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(smem)), "l"(gmem), "r"(src_bytes));
}

// ---------------------------------------------------------------------------- mbarriers and bulk copies
// An mbarrier completes a phase when its expected arrivals (and, on sm_90, its expected bytes) are in;
// waiters spin on the phase parity. Pipelines built on them let each warp wait only for the data it reads,
// where __syncthreads makes every warp wait for the slowest one at every step.
// A bulk copy (sm_90, the TMA unit's 1-D mode) moves one contiguous chunk global -> shared in one
// instruction and reports its bytes to an mbarrier; cp.async costs the load/store unit one issue per 16 B.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KBIT_BULK_COPY 1
#else
#define KBIT_BULK_COPY 0
#endif
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
}
// Initialized barriers visible to every thread (and, on sm_90, to the TMA unit) before first use.
__device__ __forceinline__ void mbarrier_init_fence() {
#if KBIT_BULK_COPY
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
  __syncthreads();
}
// Each operation takes the barrier's 32-bit shared address (a loop that computes it once saves the conversion
// per use: sm_90 derives a static shared variable's address from the CTA's cluster rank, an S2R each time) or
// a pointer.
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) { mbarrier_arrive(shared_address(bar)); }
// Arrives once this thread's earlier cp.async copies have landed (the barrier counts this arrival at init).
__device__ __forceinline__ void mbarrier_arrive_after_cp_async(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_after_cp_async(uint64_t* bar) {
  mbarrier_arrive_after_cp_async(shared_address(bar));
}
// Spins until the barrier's phase with this parity has completed (try_wait may suspend the thread a while).
#if KBIT_BULK_COPY
#define KBIT_MBARRIER_POLL "mbarrier.try_wait.parity.shared::cta.b64"
#else
#define KBIT_MBARRIER_POLL "mbarrier.test_wait.parity.shared::cta.b64"
#endif
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "KBIT_WAIT_%=:\n\t" KBIT_MBARRIER_POLL " done, [%0], %1;\n\t"
      "@!done bra KBIT_WAIT_%=;\n\t}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) { mbarrier_wait(shared_address(bar), parity); }
#if KBIT_BULK_COPY
// Bulk copies write and wgmma reads shared memory through the async proxy: shared-memory writes through the generic
// proxy (cp.async, st.shared) need this fence before an async-proxy access of the same bytes.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
  mbarrier_arrive_expect_bytes(shared_address(bar), bytes);
}
// evict_first: for data read once, whose lines then leave L2 first, so that streaming it does not push out what is
// read again soon (a split-K partial, published early and polled at the kernel's end).
__device__ __forceinline__ void bulk_copy_to_shared(void* smem, const void* gmem, uint32_t bytes, uint32_t bar,
                                                    bool evict_first = false) {
  if (evict_first) {
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
                 ::"r"(shared_address(smem)), "l"(gmem), "r"(bytes), "r"(bar), "l"(policy)
                 : "memory");
  } else {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     shared_address(smem)),
                 "l"(gmem), "r"(bytes), "r"(bar)
                 : "memory");
  }
}
__device__ __forceinline__ void bulk_copy_to_shared(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar,
                                                    bool evict_first = false) {
  bulk_copy_to_shared(smem, gmem, bytes, shared_address(bar), evict_first);
}
// Prefetch into L2 only: no effect on results, so it may run before grid_dependency_wait(). L2 is where
// the GPU's writes meet, so a prefetched line is never older than what a later load would read.
__device__ __forceinline__ void prefetch_l2(const void* gmem, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(gmem), "r"(bytes) : "memory");
}
#endif

// ---------------------------------------------------------------------------- data between CTAs
// Relaxed, GPU-scope 16-byte accesses: each 32-bit word is seen whole, served by L2 (never a stale L1 line),
// and a load in a loop is issued again every time. For words that say by themselves whether they are valid.
__device__ __forceinline__ void st_relaxed_gpu(float* p, float4 v) {
  asm volatile("st.relaxed.gpu.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}
__device__ __forceinline__ float4 ld_relaxed_gpu(const float* p) {
  float4 v;
  asm volatile("ld.relaxed.gpu.global.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p)
               : "memory");
  return v;
}
#if KBIT_BULK_COPY
// A thread-block cluster (sm_90; 1 CTA and rank 0 in a launch without clusters). Its CTAs run at once on one GPC and
// reach each other's shared memory (distributed shared memory) without going through L2.
__device__ __forceinline__ uint32_t cluster_ctas() {
  uint32_t n;
  asm("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
  return n;
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// What this CTA's shared addresses add to those of the cluster's first CTA (0 without clusters): sm_90 puts a CTA's
// rank in its shared addresses, so an address the layout fixes as a constant (a lookup table's) adds it.
__device__ __forceinline__ uint32_t cluster_window_offset(uint32_t address) {
  uint32_t first;
  asm("mapa.shared::cluster.u32 %0, %1, 0;\n" : "=r"(first) : "r"(address));
  return address - first;
}
// Every thread of every CTA of the cluster arrives (warp by warp, converged); what each wrote before, to its own
// shared memory or another CTA's, is seen by all after. In two halves where a CTA has work between them: each thread
// arrives, then waits, once per phase.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}
// A 16-byte store into the shared memory of the cluster's CTA `rank`, at the address `cta_address` has in this CTA.
__device__ __forceinline__ void st_cluster(uint32_t cta_address, uint32_t rank, float4 v) {
  uint32_t remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(cta_address), "r"(rank));
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(remote), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w)
               : "memory");
}
// A 16-byte load from the shared memory of the cluster's CTA `rank`, at the address `cta_address` has in this CTA.
__device__ __forceinline__ float4 ld_cluster(uint32_t cta_address, uint32_t rank) {
  uint32_t remote;
  float4 v;
  asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(cta_address), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}
#endif

// One L2 round trip of split-K partials, repeated until none of the wanted words is kPartialEmpty (not landed yet):
// v[i] = *word(i) for each i with wanted(i).
template <int N, typename Wanted, typename Word>
__device__ __forceinline__ void ld_landed_gpu(float4 (&v)[N], Wanted wanted, Word word) {
  bool landed;
  do {
    landed = true;
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (wanted(i)) v[i] = ld_relaxed_gpu(word(i));
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint32_t e = kPartialEmpty;
      if (wanted(i))
        landed &= __float_as_uint(v[i].x) != e && __float_as_uint(v[i].y) != e && __float_as_uint(v[i].z) != e &&
                  __float_as_uint(v[i].w) != e;
    }
    if (!landed) __nanosleep(128);  // not yet: wait a little before asking L2 again
  } while (!landed);
}

// ---------------------------------------------------------------------------- programmatic dependent launch
// Launched with programmatic stream serialization (sm_90), a kernel may start while the previous kernel
// of the stream drains. Before grid_dependency_wait(), which waits until the previous kernel has finished and its
// writes are visible, it may read only what that kernel cannot be writing (the GEMM: its weights, when the host
// says they are settled) and prefetch into L2.
// allow_dependent_launch() lets the next kernel start the same way. Both are no-ops in a normal launch.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------- tensor cores
// D(16x8, f32) += A(16x16, row) * B(16x8, col). Register order of A: {row g k lo, row g+8 k lo,
// row g k hi, row g+8 k hi}; of B: {k lo, k hi} for column g; of D: {(g,2q), (g,2q+1), (g+8,2q), (g+8,2q+1)}.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8 x 8 matrices of 16-bit values from shared memory: lane l gives the address of row l % 8 of matrix l / 8
// (16 contiguous bytes); register i of lane 4g + q receives row g, columns 2q, 2q + 1 of matrix i, which is
// mma_16816's B fragment for token g when the rows are tokens and the columns k. Volatile, like lds128_if:
// it must stay below the wait for the barrier that says its data landed.
__device__ __forceinline__ void ldmatrix_x4(uint32_t address, uint4& v) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The converse of ldmatrix_x4, transposed (sm_90): register i of lane 4g + q holds row g, columns 2q, 2q + 1 of
// matrix i (an mma D fragment packed to 16 bits), and lane l gives the address of row l % 8 of stored matrix l / 8,
// which receives column l % 8 of matrix l / 8 (16 contiguous bytes). A D fragment of weight rows x tokens goes out
// token-major.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t address, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
#endif

// ---------------------------------------------------------------------------- warpgroup MMA (sm_90)
// wgmma: the 4 warps of a warpgroup multiply A (64 x 16, from registers: warp i holds rows 16i..16i+15 in
// mma_16816's A order) by B (16 x N, read from shared memory through a descriptor) into D (64 x N, f32, warp i
// holds rows 16i.. as N/8 mma_16816 D fragments). Asynchronous: issued, committed as a group, waited for.
// wgmma is an sm_90a feature (not in plain sm_90 code, nor on later architectures): kbit/_build.py builds
// Hopper GPUs as 9.0a, and the host picks the wgmma path only on compute capability 9.x.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_WGMMA 1
#else
#define KBIT_WGMMA 0
#endif

// Shared-memory matrix descriptor of a K-major operand without swizzle: 8 x 16-byte "core matrices" of 128
// contiguous bytes; lead_bytes apart along K, stride_bytes apart along N (PTX ISA, matrix descriptor format).
__device__ __forceinline__ uint64_t wgmma_descriptor(uint32_t smem_address, uint32_t lead_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) | static_cast<uint64_t>(lead_bytes >> 4) << 16 |
         static_cast<uint64_t>(stride_bytes >> 4) << 32;
}

#if KBIT_WGMMA
// Orders this thread's register writes (A fragments, accumulators) before the wgmmas that read them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// The accumulators after a wait: redefined here, so the compiler reads them only after it.
template <int F>
__device__ __forceinline__ void fence_accumulators(float (&d)[F][4]) {
#pragma unroll
  for (int f = 0; f < F; ++f) asm volatile("" : "+f"(d[f][0]), "+f"(d[f][1]), "+f"(d[f][2]), "+f"(d[f][3])::"memory");
}

// D(64 x N) += A(64 x 16) * B(16 x N), N = 8 * (fragments of d). Inline asm cannot loop, so each N's operand
// list is written out; KBIT_WGMMA_ASM adds the instruction for both 16-bit types (scale-d = 1: accumulate).
#define KBIT_WGMMA_ASM(SHAPE, ONE, OPERANDS, ...)                                                              \
  if constexpr (std::is_same<T, __half>::value)                                                               \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, " ONE ", 0;\n\twgmma.mma_async.sync.aligned." SHAPE  \
                 ".f32.f16.f16 " OPERANDS ", p, 1, 1, 0;\n\t}\n"                                                  \
                 : __VA_ARGS__);                                                                               \
  else                                                                                                         \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, " ONE ", 0;\n\twgmma.mma_async.sync.aligned." SHAPE  \
                 ".f32.bf16.bf16 " OPERANDS ", p, 1, 1, 0;\n\t}\n"                                                \
                 : __VA_ARGS__);
#define KBIT_ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
template <int N>
struct Wgmma;
template <>
struct Wgmma<32> {
  template <typename T>
  static __device__ __forceinline__ void run(float (&d)[4][4], const uint32_t (&a)[4], uint64_t b_desc) {
    KBIT_WGMMA_ASM("m64n32k16", "%21",
                   "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" "}, {%16, %17, %18, %19}, %20",
                   KBIT_ACC4(0), KBIT_ACC4(1), KBIT_ACC4(2), KBIT_ACC4(3)
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1))
  }
};
template <>
struct Wgmma<64> {
  template <typename T>
  static __device__ __forceinline__ void run(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b_desc) {
    KBIT_WGMMA_ASM("m64n64k16", "%37",
                   "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                   "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" "}, {%32, %33, %34, %35}, %36",
                   KBIT_ACC4(0), KBIT_ACC4(1), KBIT_ACC4(2), KBIT_ACC4(3),
                   KBIT_ACC4(4), KBIT_ACC4(5), KBIT_ACC4(6), KBIT_ACC4(7)
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1))
  }
};
template <>
struct Wgmma<128> {
  template <typename T>
  static __device__ __forceinline__ void run(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b_desc) {
    KBIT_WGMMA_ASM("m64n128k16", "%69",
                   "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                   "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                   "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                   "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" "}, {%64, %65, %66, %67}, %68",
                   KBIT_ACC4(0), KBIT_ACC4(1), KBIT_ACC4(2), KBIT_ACC4(3),
                   KBIT_ACC4(4), KBIT_ACC4(5), KBIT_ACC4(6), KBIT_ACC4(7),
                   KBIT_ACC4(8), KBIT_ACC4(9), KBIT_ACC4(10), KBIT_ACC4(11),
                   KBIT_ACC4(12), KBIT_ACC4(13), KBIT_ACC4(14), KBIT_ACC4(15)
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1))
  }
};
template <>
struct Wgmma<256> {
  template <typename T>
  static __device__ __forceinline__ void run(float (&d)[32][4], const uint32_t (&a)[4], uint64_t b_desc) {
    KBIT_WGMMA_ASM("m64n256k16", "%133",
                   "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                   "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                   "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                   "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                   "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                   "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                   "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
                   "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
                   "}, {%128, %129, %130, %131}, %132",
                   KBIT_ACC4(0), KBIT_ACC4(1), KBIT_ACC4(2), KBIT_ACC4(3),
                   KBIT_ACC4(4), KBIT_ACC4(5), KBIT_ACC4(6), KBIT_ACC4(7),
                   KBIT_ACC4(8), KBIT_ACC4(9), KBIT_ACC4(10), KBIT_ACC4(11),
                   KBIT_ACC4(12), KBIT_ACC4(13), KBIT_ACC4(14), KBIT_ACC4(15),
                   KBIT_ACC4(16), KBIT_ACC4(17), KBIT_ACC4(18), KBIT_ACC4(19),
                   KBIT_ACC4(20), KBIT_ACC4(21), KBIT_ACC4(22), KBIT_ACC4(23),
                   KBIT_ACC4(24), KBIT_ACC4(25), KBIT_ACC4(26), KBIT_ACC4(27),
                   KBIT_ACC4(28), KBIT_ACC4(29), KBIT_ACC4(30), KBIT_ACC4(31)
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1))
  }
};
#undef KBIT_ACC4
#undef KBIT_WGMMA_ASM

// Register budget of this warp's warpgroup from here on (sm_90a): a producer warpgroup that only issues copies
// gives registers back, consumer warpgroups that hold accumulators take them. Every warp of the warpgroup runs
// the same one; the kernel needs a register cap at entry (__launch_bounds__(threads, 1)).
template <int N>
__device__ __forceinline__ void warpgroup_registers_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void warpgroup_registers_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
#endif  // KBIT_WGMMA

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle the tensor copy engine writes
// (CU_TENSOR_MAP_SWIZZLE_128B): rows of 128 B (64 16-bit k), the 16-byte chunks of row r at chunk ^ (r % 8), 8-row
// atoms of 1024 B stacked along N. The atom must sit at a 1024-byte-aligned address; a k16 slice inside a row
// starts 32 B further (the hardware applies the swizzle to the address bits, so the offset carries over).
__device__ __forceinline__ uint64_t wgmma_descriptor_sw128(uint32_t smem_address) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) | static_cast<uint64_t>(1024 >> 4) << 32 |
         static_cast<uint64_t>(1) << 62;
}

// A descriptor advanced by `units` of 16 bytes (its start address field), computed where it is used: a volatile
// asm stays between the wgmmas around it, so the compiler cannot compute all of a loop's descriptors ahead and
// hold them in registers.
__device__ __forceinline__ uint64_t descriptor_plus(uint64_t desc, uint32_t units) {
  uint64_t r;
  asm volatile("add.s64 %0, %1, %2;\n" : "=l"(r) : "l"(desc), "l"(static_cast<uint64_t>(units)));
  return r;
}

#if KBIT_BULK_COPY
// A 2-D tile of a tensor map (the TMA unit's tiled mode) global -> shared, completion on an mbarrier; elements
// outside the tensor arrive as zeros and count towards the bytes like the others. c0 is the inner coordinate.
// The map must live in kernel parameter, constant or global memory (a __grid_constant__ parameter here).
__device__ __forceinline__ void tensor_copy_2d_to_shared(void* smem, const void* tensor_map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          shared_address(smem)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(shared_address(bar))
      : "memory");
}
// The converse, shared -> global: elements outside the tensor are not written. The copy joins this thread's open
// bulk group; bulk_commit_group closes it, and bulk_wait_read waits until every closed group of the thread has read
// its shared-memory source (the global writes may still be on their way; the kernel's end orders them before the
// next kernel's reads). Shared-memory writes through the generic proxy need fence_proxy_async_shared first.
__device__ __forceinline__ void tensor_store_2d_from_shared(const void* tensor_map, int c0, int c1, const void* smem) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(tensor_map)),
               "r"(c0), "r"(c1), "r"(shared_address(smem))
               : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
#endif

}  // namespace kbit
