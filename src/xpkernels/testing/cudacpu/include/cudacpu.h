// cudacpu.h -- CUDA's execution model on the CPU, for running unchanged .cu files.
//
// Force-included (g++ -include) before every .cu that xpkernels.testing.cudacpu
// compiles. Each CUDA thread is a fiber (or, in the "threads" mode, an OS
// thread); the runtime (cudacpu_runtime.cpp) schedules the threads of one
// block, implements __syncthreads and the warp collectives, detects divergent
// barriers and partial-warp collectives and reports them as launch errors.
//
// Shared memory: `__shared__` becomes a function-local static (collected into
// one linker section that the runtime refills with garbage before every
// block); `extern __shared__ T name[];` becomes a pointer to the launch's
// dynamic shared memory (the Python side rewrites that declaration).
//
// nvcuda::wmma fragments use a deliberately scrambled, non-hardware element
// layout: kernels may apply element-wise operations to `frag.x[i]` but cannot
// depend on which matrix element a lane holds.
#pragma once

#define __CUDACPU__ 1

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __restrict__ __restrict
#define __align__(n) alignas(n)
#define __launch_bounds__(...)
#define __shared__ __cudacpu_shared__
#define __CUDA_ARCH__ 900

// ---------------------------------------------------------------- vector types
struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
#define CUDACPU_VEC2(T, N) struct alignas(2 * sizeof(T)) N { T x, y; }; \
    inline N make_##N(T x, T y) { return N{x, y}; }
#define CUDACPU_VEC4(T, N) struct alignas(4 * sizeof(T)) N { T x, y, z, w; }; \
    inline N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }
CUDACPU_VEC2(float, float2)
CUDACPU_VEC4(float, float4)
CUDACPU_VEC2(int, int2)
CUDACPU_VEC4(int, int4)
CUDACPU_VEC2(unsigned, uint2)
CUDACPU_VEC4(unsigned, uint4)
CUDACPU_VEC2(double, double2)
#undef CUDACPU_VEC2
#undef CUDACPU_VEC4

// ---------------------------------------------------------------- runtime interface
namespace cudacpu {

struct ThreadInfo {
    uint3 thread_idx;   // threadIdx
    uint3 block_idx;    // blockIdx
    dim3 block_dim;     // blockDim
    dim3 grid_dim;      // gridDim
    int linear;         // linear thread index within the block
};

ThreadInfo* current();
void* dynamic_shared();

// Collective kinds handled by warp_collective.
enum Kind : int {
    K_SHFL_IDX = 1, K_SHFL_XOR, K_SHFL_DOWN, K_SHFL_UP,
    K_BALLOT, K_ALL, K_ANY, K_SYNCWARP, K_CALLBACK,
};

// Called once, by the last lane to arrive, with every participating lane's
// `data` pointer (index = lane; lanes outside the mask are nullptr). Returns
// nullptr or an error message (a static string).
typedef const char* (*Callback)(void* const* lane_data);

struct WarpOp {
    int kind;
    unsigned mask;
    unsigned long long value;   // this lane's value (bits)
    int arg;                    // source lane / lane mask / delta
    int width;
    void* data;                 // K_CALLBACK: this lane's data
    Callback callback;          // K_CALLBACK: the completion
    const char* name;           // the intrinsic, for messages
    const char* file;
    int line;
};

void syncthreads(const char* file, int line);
unsigned long long warp_collective(const WarpOp& op);
[[noreturn]] void fail(const char* file, int line, const char* message);

template <class T>
unsigned long long to_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    unsigned long long b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
T from_bits(unsigned long long b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

template <class T>
T shfl(int kind, const char* name, unsigned mask, T v, int arg, int width, const char* file,
       int line) {
    WarpOp op{kind, mask, to_bits(v), arg, width, nullptr, nullptr, name, file, line};
    return from_bits<T>(warp_collective(op));
}

inline unsigned vote(int kind, const char* name, unsigned mask, int pred, const char* file,
                     int line) {
    WarpOp op{kind, mask, static_cast<unsigned long long>(pred != 0), 0, 32, nullptr, nullptr,
              name, file, line};
    return static_cast<unsigned>(warp_collective(op));
}

inline unsigned lane_id() { return static_cast<unsigned>(current()->linear) & 31u; }

}  // namespace cudacpu

#define threadIdx (::cudacpu::current()->thread_idx)
#define blockIdx (::cudacpu::current()->block_idx)
#define blockDim (::cudacpu::current()->block_dim)
#define gridDim (::cudacpu::current()->grid_dim)
#define warpSize 32

#define __syncthreads() ::cudacpu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(mask) ((void)::cudacpu::vote(::cudacpu::K_SYNCWARP, "__syncwarp", (mask), 1, __FILE__, __LINE__))
#define __shfl_sync(mask, v, src, ...) ::cudacpu::shfl(::cudacpu::K_SHFL_IDX, "__shfl_sync", (mask), (v), (src), cudacpu_width(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, lm, ...) ::cudacpu::shfl(::cudacpu::K_SHFL_XOR, "__shfl_xor_sync", (mask), (v), (lm), cudacpu_width(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, d, ...) ::cudacpu::shfl(::cudacpu::K_SHFL_DOWN, "__shfl_down_sync", (mask), (v), (d), cudacpu_width(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, d, ...) ::cudacpu::shfl(::cudacpu::K_SHFL_UP, "__shfl_up_sync", (mask), (v), (d), cudacpu_width(__VA_ARGS__), __FILE__, __LINE__)
#define __ballot_sync(mask, p) ::cudacpu::vote(::cudacpu::K_BALLOT, "__ballot_sync", (mask), (p), __FILE__, __LINE__)
#define __all_sync(mask, p) static_cast<int>(::cudacpu::vote(::cudacpu::K_ALL, "__all_sync", (mask), (p), __FILE__, __LINE__))
#define __any_sync(mask, p) static_cast<int>(::cudacpu::vote(::cudacpu::K_ANY, "__any_sync", (mask), (p), __FILE__, __LINE__))
#define __trap() ::cudacpu::fail(__FILE__, __LINE__, "__trap() called")

inline int cudacpu_width() { return 32; }
inline int cudacpu_width(int w) { return w; }

// ---------------------------------------------------------------- integer/float intrinsics
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
template <class T> inline T __ldg(const T* p) { return *p; }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __exp2f(float x) { return std::exp2(x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

// ---------------------------------------------------------------- atomics
template <class T> inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
template <class T> inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
template <class T> inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
template <class T> inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }
template <class T> inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
template <class T> inline T atomicCAS(T* p, T compare, T v) {
    __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return compare;
}
template <class T> inline T atomicMax(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}
template <class T> inline T atomicMin(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old > v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}
template <class F, class Op> inline F cudacpu_atomic_float(F* p, F v, Op op) {
    static_assert(sizeof(F) == 4 || sizeof(F) == 8, "float or double");
    using U = typename std::conditional<sizeof(F) == 4, unsigned, unsigned long long>::type;
    U* up = reinterpret_cast<U*>(p);
    U old = __atomic_load_n(up, __ATOMIC_RELAXED);
    for (;;) {
        F f;
        std::memcpy(&f, &old, sizeof(F));
        F g = op(f, v);
        U n;
        std::memcpy(&n, &g, sizeof(F));
        if (__atomic_compare_exchange_n(up, &old, n, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return f;
    }
}
template <> inline float atomicAdd<float>(float* p, float v) {
    return cudacpu_atomic_float(p, v, [](float a, float b) { return a + b; });
}
template <> inline double atomicAdd<double>(double* p, double v) {
    return cudacpu_atomic_float(p, v, [](double a, double b) { return a + b; });
}
template <> inline float atomicExch<float>(float* p, float v) {
    return cudacpu_atomic_float(p, v, [](float, float b) { return b; });
}

// ---------------------------------------------------------------- half and bfloat16
struct __half {
    unsigned short bits;
    __half() = default;
    __half(float f) { _Float16 h = static_cast<_Float16>(f); std::memcpy(&bits, &h, 2); }
    operator float() const { _Float16 h; std::memcpy(&h, &bits, 2); return static_cast<float>(h); }
};
struct __nv_bfloat16 {
    unsigned short bits;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) {
        unsigned u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            bits = static_cast<unsigned short>((u >> 16) | 0x40u);  // quiet NaN
        } else {
            u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
            bits = static_cast<unsigned short>(u >> 16);
        }
    }
    operator float() const { return __uint_as_float(static_cast<unsigned>(bits) << 16); }
};
struct alignas(4) __half2 { __half x, y; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __half half;
typedef __half2 half2;
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

inline float __half2float(__half h) { return static_cast<float>(h); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return static_cast<float>(h); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
inline __half2 __float22half2_rn(float2 v) { return __floats2half2_rn(v.x, v.y); }
inline float2 __half22float2(__half2 v) { return float2{float(v.x), float(v.y)}; }
inline __half2 __halves2half2(__half a, __half b) { return __half2{a, b}; }
inline float __low2float(__half2 v) { return float(v.x); }
inline float __high2float(__half2 v) { return float(v.y); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(b)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return float2{float(v.x), float(v.y)}; }
inline float __low2float(__nv_bfloat162 v) { return float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return float(v.y); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162{a, b}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline __half __ushort_as_half(unsigned short b) { __half h; h.bits = b; return h; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { __nv_bfloat16 h; h.bits = b; return h; }

// ---------------------------------------------------------------- nvcuda::wmma
namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {

// Position (row * 16 + col) of element e of lane l: a fixed scrambled
// permutation of the 256 positions, different for each fragment use, so a
// kernel that assumes the hardware layout computes garbage here.
template <class Use>
inline int position(int lane, int e) {
    const int salt = std::is_same<Use, matrix_a>::value ? 11 : (std::is_same<Use, matrix_b>::value ? 29 : 53);
    int i = lane * 8 + e;
    return (i * 167 + salt) & 255;  // 167 is odd: a bijection of 0..255
}

}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout = void>
class fragment {
    static_assert(M == 16 && N == 16 && K == 16, "cudacpu supports 16x16x16 wmma fragments");
public:
    static constexpr int num_elements = 8;
    T x[num_elements];
};

namespace detail {

template <class T> inline float as_float(T v) { return static_cast<float>(v); }

struct Transfer {
    const void* ptr;
    unsigned ldm;
};

inline const char* check_same(void* const* lanes) {
    const Transfer* t0 = static_cast<const Transfer*>(lanes[0]);
    for (int l = 1; l < 32; ++l) {
        const Transfer* t = static_cast<const Transfer*>(lanes[l]);
        if (t->ptr != t0->ptr || t->ldm != t0->ldm)
            return "wmma load/store: lanes of the warp passed different pointers or ldm";
    }
    return nullptr;
}

template <class T>
inline void check_transfer(const void* ptr, unsigned ldm, const char* file, int line, const char* what) {
    if (reinterpret_cast<uintptr_t>(ptr) % 32 != 0)
        ::cudacpu::fail(file, line, "wmma: matrix pointer must be 32-byte (256-bit) aligned");
    if ((ldm * sizeof(T)) % 16 != 0)
        ::cudacpu::fail(file, line, "wmma: ldm must be a multiple of 16 bytes");
    Transfer t{ptr, ldm};
    ::cudacpu::WarpOp op{::cudacpu::K_CALLBACK, 0xffffffffu, 0, 0, 32, &t, &check_same, what, file, line};
    ::cudacpu::warp_collective(op);
}

template <class Use, class T, class Layout>
inline void load(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm, bool col,
                 const char* file, int line) {
    check_transfer<T>(p, ldm, file, line, "wmma::load_matrix_sync");
    const int lane = static_cast<int>(::cudacpu::lane_id());
    for (int e = 0; e < 8; ++e) {
        int pos = position<Use>(lane, e), r = pos / 16, c = pos % 16;
        f.x[e] = col ? p[c * ldm + r] : p[r * ldm + c];
    }
}

template <class TA, class TB>
struct MmaLane {
    float* d;
    const TA* a;
    const TB* b;
    const float* c;
};

template <class TA, class TB>
inline const char* mma_complete(void* const* lanes) {
    float A[256], B[256], C[256];
    for (int l = 0; l < 32; ++l) {
        const MmaLane<TA, TB>* m = static_cast<const MmaLane<TA, TB>*>(lanes[l]);
        for (int e = 0; e < 8; ++e) {
            A[position<matrix_a>(l, e)] = as_float(m->a[e]);
            B[position<matrix_b>(l, e)] = as_float(m->b[e]);
            C[position<accumulator>(l, e)] = m->c[e];
        }
    }
    float D[256];
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
            float s = C[i * 16 + j];
            for (int k = 0; k < 16; ++k) s += A[i * 16 + k] * B[k * 16 + j];
            D[i * 16 + j] = s;
        }
    for (int l = 0; l < 32; ++l) {
        const MmaLane<TA, TB>* m = static_cast<const MmaLane<TA, TB>*>(lanes[l]);
        for (int e = 0; e < 8; ++e) m->d[e] = D[position<accumulator>(l, e)];
    }
    return nullptr;
}

}  // namespace detail

template <class T, class Layout>
inline void cudacpu_load_matrix(fragment<matrix_a, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm,
                                const char* file, int line) {
    detail::load(f, p, ldm, std::is_same<Layout, col_major>::value, file, line);
}
template <class T, class Layout>
inline void cudacpu_load_matrix(fragment<matrix_b, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm,
                                const char* file, int line) {
    detail::load(f, p, ldm, std::is_same<Layout, col_major>::value, file, line);
}
inline void cudacpu_load_matrix(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm,
                                layout_t layout, const char* file, int line) {
    detail::load(f, p, ldm, layout == mem_col_major, file, line);
}
inline void cudacpu_store_matrix(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                                 layout_t layout, const char* file, int line) {
    detail::check_transfer<float>(p, ldm, file, line, "wmma::store_matrix_sync");
    const int lane = static_cast<int>(::cudacpu::lane_id());
    for (int e = 0; e < 8; ++e) {
        int pos = detail::position<accumulator>(lane, e), r = pos / 16, c = pos % 16;
        (layout == mem_col_major ? p[c * ldm + r] : p[r * ldm + c]) = f.x[e];
    }
}
template <class TA, class LA, class TB, class LB>
inline void cudacpu_mma(fragment<accumulator, 16, 16, 16, float>& d,
                        const fragment<matrix_a, 16, 16, 16, TA, LA>& a,
                        const fragment<matrix_b, 16, 16, 16, TB, LB>& b,
                        const fragment<accumulator, 16, 16, 16, float>& c, const char* file, int line) {
    static_assert(std::is_same<TA, TB>::value, "wmma: a and b fragments must have one element type");
    float out[8];
    detail::MmaLane<TA, TB> m{out, a.x, b.x, c.x};
    ::cudacpu::WarpOp op{::cudacpu::K_CALLBACK, 0xffffffffu, 0, 0, 32, &m, &detail::mma_complete<TA, TB>,
                         "wmma::mma_sync", file, line};
    ::cudacpu::warp_collective(op);
    for (int e = 0; e < 8; ++e) d.x[e] = out[e];
}
template <class Use, class T, class Layout, class V>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const V& v) {
    for (int e = 0; e < 8; ++e) f.x[e] = static_cast<T>(v);
}

}  // namespace wmma
}  // namespace nvcuda

#define load_matrix_sync(...) cudacpu_load_matrix(__VA_ARGS__, __FILE__, __LINE__)
#define store_matrix_sync(...) cudacpu_store_matrix(__VA_ARGS__, __FILE__, __LINE__)
#define mma_sync(...) cudacpu_mma(__VA_ARGS__, __FILE__, __LINE__)

// ---------------------------------------------------------------- launch glue
namespace cudacpu {

template <class... A, std::size_t... I>
inline void invoke_impl(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_reference<A>::type*>(args[I])...);
}
template <class... A>
inline void invoke(void (*f)(A...), void** args) {
    invoke_impl(f, args, std::index_sequence_for<A...>{});
}

// One code per parameter: p (pointer), i<N>/u<N> (integer of N bytes),
// f<N> (floating point), s<N> (anything else, N bytes).
template <class T>
inline const char* param_code() {
    typedef typename std::remove_cv<T>::type U;
    if (std::is_pointer<U>::value) return "p";
    if (std::is_floating_point<U>::value) return sizeof(U) == 4 ? "f4" : "f8";
    if (std::is_integral<U>::value) {
        if (std::is_signed<U>::value)
            return sizeof(U) == 1 ? "i1" : sizeof(U) == 2 ? "i2" : sizeof(U) == 4 ? "i4" : "i8";
        return sizeof(U) == 1 ? "u1" : sizeof(U) == 2 ? "u2" : sizeof(U) == 4 ? "u4" : "u8";
    }
    return "s";
}
template <class... A>
inline void signature(void (*)(A...), const char** out) {
    const char* codes[] = {param_code<A>()..., nullptr};
    for (std::size_t i = 0; i < sizeof...(A); ++i) out[i] = codes[i];
    out[sizeof...(A)] = nullptr;
}

struct Launch {
    unsigned grid[3];
    unsigned block[3];
    unsigned long long shared_bytes;
    int mode;             // 0: fibers, 1: one OS thread per CUDA thread
    unsigned long long shuffle_seed;   // 0: threads in index order; else a shuffled schedule
    unsigned long long fill_seed;      // seeds the garbage written into shared memory
};

}  // namespace cudacpu

extern "C" int cudacpu_launch(void (*entry)(void**), void** args, const cudacpu::Launch* launch,
                              char* error, unsigned long error_size);
