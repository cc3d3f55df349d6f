// GeGLU: the gated kernels of gated.cuh with a GELU activation,
//   Gelu (approximate="none"):     f(a) = a * Phi(a),  f'(a) = Phi(a) + a * phi(a),
//       Phi(a) = erfc(-a / sqrt(2)) / 2 (relative to its size in both tails),
//       phi(a) = exp(-a^2 / 2) / sqrt(2 pi);
//   GeluTanh (approximate="tanh"): f(a) = a * s,  f'(a) = s + a * s * (1 - s) * z'(a),
//       s = sigmoid(z), z = 2 sqrt(2/pi) (a + 0.044715 a^3)  (0.5 (1 + tanh u) = sigmoid(2 u)),
// so y = f(a) * b, da = dy * b * f'(a), db = dy * f(a). Squares are of a clipped to +-LIMIT
// (beyond, the gate is exactly 0 or 1 and the density 0; +-1e20 keeps finite gradients), the
// factors a unclipped. NaN propagates, and a = +-inf give
// what torch.nn.functional.gelu gives (gelu(+inf) = +inf; gelu(-inf) and both derivatives
// at +-inf are NaN: inf * 0).
#include "gated.cuh"

namespace {

constexpr float SQRT_HALF = 0.70710678118654752f;       // 1 / sqrt(2)
constexpr float DENSITY_SCALE = 0.39894228040143268f;   // 1 / sqrt(2 pi)
constexpr float TANH_SCALE = 1.5957691216057308f;       // 2 sqrt(2 / pi)
constexpr float TANH_CUBE = 0.044715f;                  // the cubic coefficient
constexpr float LIMIT = 40.0f;  // squares of the gate are taken clipped to +-LIMIT (no overflow)

// a clipped to +-LIMIT (NaN gives a finite value: the unclipped factor a keeps it NaN).
__device__ __forceinline__ float clipped(float a) { return fminf(fmaxf(a, -LIMIT), LIMIT); }

}  // namespace

struct Gelu {
    static __device__ __forceinline__ float value(float a) {
        return a * (0.5f * erfcf(-a * SQRT_HALF));
    }
    static __device__ __forceinline__ void value_and_slope(float a, float& f, float& df) {
        const float cdf = 0.5f * erfcf(-a * SQRT_HALF);
        f = a * cdf;
        const float c = clipped(a);
        df = cdf + a * (expf(-0.5f * c * c) * DENSITY_SCALE);
    }
};

struct GeluTanh {
    static __device__ __forceinline__ float value(float a) {
        const float c = clipped(a);
        float slope;
        return a * xk::sigmoid(TANH_SCALE * c * (1.0f + TANH_CUBE * c * c), slope);
    }
    static __device__ __forceinline__ void value_and_slope(float a, float& f, float& df) {
        const float c = clipped(a);
        const float square = c * c;
        float slope;
        const float s = xk::sigmoid(TANH_SCALE * c * (1.0f + TANH_CUBE * square), slope);
        f = a * s;
        df = s + a * slope * (TANH_SCALE * (1.0f + 3.0f * TANH_CUBE * square));
    }
};
