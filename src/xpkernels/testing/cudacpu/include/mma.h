// mma.h for xpkernels.testing.cudacpu: everything lives in cudacpu.h.
#pragma once
#include "cudacpu.h"
