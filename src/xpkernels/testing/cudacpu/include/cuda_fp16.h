// cuda_fp16.h for xpkernels.testing.cudacpu: everything lives in cudacpu.h.
#pragma once
#include "cudacpu.h"
