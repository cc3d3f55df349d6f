// SwiGLU: the gated kernels of gated.cuh with the SiLU activation,
//   f(a) = silu(a) = a * s,   f'(a) = s + a * s * (1 - s),   s = sigmoid(a),
// so y = silu(a) * b, da = dy * b * f'(a), db = dy * silu(a). The sigmoid comes from
// exp(-|a|), which never overflows; NaN propagates, and a = +-inf give what
// torch.nn.functional.silu gives (silu(+inf) = +inf; silu(-inf) and both derivatives at
// +-inf are NaN: inf * 0).
#include "gated.cuh"

struct Silu {
    static __device__ __forceinline__ float value(float a) {
        float slope;
        return a * xk::sigmoid(a, slope);
    }
    static __device__ __forceinline__ void value_and_slope(float a, float& f, float& df) {
        float slope;
        const float s = xk::sigmoid(a, slope);
        f = a * s;
        df = s + a * slope;
    }
};
