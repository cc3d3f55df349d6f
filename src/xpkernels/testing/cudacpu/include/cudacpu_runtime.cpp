// cudacpu_runtime.cpp -- the scheduler behind cudacpu.h.
//
// Blocks run one after another (in index order, or shuffled). The threads of
// a block are fibers (ucontext) switched cooperatively on one OS thread, or
// (mode 1) one OS thread each, for ThreadSanitizer. Every barrier and warp
// collective goes through one state machine that detects, and reports as a
// launch error instead of hanging:
//   - a __syncthreads some threads reach after others returned, or two
//     different __syncthreads waited on at once (divergent barrier);
//   - a warp collective whose mask names a lane that returned, that does not
//     exist, or that never arrives (deadlock: a partial warp);
//   - lanes of one collective that disagree on the operation or the mask.
#include "cudacpu.h"

#include <pthread.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <condition_variable>
#include <cstdarg>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define CUDACPU_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define CUDACPU_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define CUDACPU_POISON(p, n) ((void)(p), (void)(n))
#define CUDACPU_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

// Bounds of the kernel object's static __shared__ variables (linker script).
extern "C" char __cudacpu_shared_start[];
extern "C" char __cudacpu_shared_end[];

namespace cudacpu {
namespace {

constexpr unsigned long long kMaxDynamicShared = 227 * 1024;  // sm_90's opt-in maximum per block
constexpr std::size_t kFiberStack = 256 * 1024;
constexpr std::size_t kThreadStack = 1024 * 1024;

alignas(256) unsigned char g_dynamic[kMaxDynamicShared];

enum State { RUNNABLE, BARRIER, WARP, DONE };

struct Thread {
    ThreadInfo info;
    State state;
    const char* file;    // where it waits
    int line;
    WarpOp op;           // the collective it waits in
    unsigned long long result;
    ucontext_t context;
    pthread_t os_thread;
    jmp_buf exit_jump;
};

struct Block {
    int n = 0;
    std::vector<Thread> threads;
    int n_barrier = 0, n_blocked = 0, n_done = 0;
    const char* barrier_file = nullptr;
    int barrier_line = 0;
    bool failed = false;
    std::string error;
    int mode = 0;
    std::mutex mutex;
    std::condition_variable wake;
    ucontext_t scheduler;
    void (*entry)(void**) = nullptr;
    void** args = nullptr;
};

std::mutex g_launch_mutex;
Block* g_block = nullptr;
thread_local Thread* t_current = nullptr;

std::string format(const char* fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

std::string who(const Thread& t) {
    return format("thread (%u,%u,%u)", t.info.thread_idx.x, t.info.thread_idx.y, t.info.thread_idx.z);
}

class Lock {
public:
    explicit Lock(Block& b) : b_(b), lk_(b.mutex, std::defer_lock) {
        if (b.mode == 1) lk_.lock();
    }
    std::unique_lock<std::mutex>& get() { return lk_; }
    void release() {
        if (lk_.owns_lock()) lk_.unlock();
    }

private:
    Block& b_;
    std::unique_lock<std::mutex> lk_;
};

// Leave the current CUDA thread for good (after the block failed).
[[noreturn]] void abandon(Lock& lock) {
    Block& b = *g_block;
    Thread* self = t_current;
    lock.release();
    if (b.mode == 1) {
        b.wake.notify_all();
        longjmp(self->exit_jump, 1);
    }
    swapcontext(&self->context, &b.scheduler);
    std::abort();  // a failed block's fibers are never resumed
}

[[noreturn]] void fail_locked(Lock& lock, const std::string& message) {
    Block& b = *g_block;
    if (!b.failed) {
        b.failed = true;
        b.error = message;
    }
    abandon(lock);
}

std::string describe_deadlock(Block& b) {
    std::string s = "deadlock: every thread of the block waits and none can proceed:";
    int shown = 0;
    for (const Thread& t : b.threads) {
        if (t.state == RUNNABLE || t.state == DONE) continue;
        if (++shown > 8) {
            s += "\n  ...";
            break;
        }
        if (t.state == BARRIER) {
            s += format("\n  %s waits at __syncthreads (%s:%d)", who(t).c_str(), t.file, t.line);
        } else {
            s += format("\n  %s waits in %s(mask=0x%08x) (%s:%d)", who(t).c_str(), t.op.name, t.op.mask,
                        t.file, t.line);
        }
    }
    s += "\n(a warp collective needs every lane of its mask to reach it; a partial warp never completes)";
    return s;
}

// Block until t_current is released; fibers always yield to the scheduler.
void wait_released(Lock& lock, State blocked) {
    Block& b = *g_block;
    Thread* self = t_current;
    if (b.n_blocked + b.n_done == b.n && self->state == blocked)
        fail_locked(lock, describe_deadlock(b));
    if (b.mode == 1) {
        b.wake.wait(lock.get(), [&] { return self->state != blocked || b.failed; });
        if (b.failed) abandon(lock);
        return;
    }
    swapcontext(&self->context, &b.scheduler);
}

void finish_collective(Lock& lock, Block& b, int base, unsigned mask) {
    Thread& first = b.threads[base + __builtin_ctz(mask)];
    const WarpOp& op = first.op;
    unsigned long long all = ~0ull, any = 0, ballot = 0;
    for (int l = 0; l < 32; ++l) {
        if (!(mask >> l & 1u)) continue;
        unsigned long long v = b.threads[base + l].op.value;
        all &= v;
        any |= v;
        ballot |= v << l;
    }
    if (op.kind == K_CALLBACK) {
        void* lanes[32] = {};
        for (int l = 0; l < 32; ++l)
            if (mask >> l & 1u) lanes[l] = b.threads[base + l].op.data;
        if (const char* err = op.callback(lanes))
            fail_locked(lock, format("%s (%s:%d): %s", op.name, op.file, op.line, err));
    }
    for (int l = 0; l < 32; ++l) {
        if (!(mask >> l & 1u)) continue;
        Thread& t = b.threads[base + l];
        const int w = t.op.width, seg = l - l % w;
        int src = l;
        switch (op.kind) {
        case K_SHFL_IDX: src = seg + ((t.op.arg % w) + w) % w; break;
        case K_SHFL_XOR: src = l ^ t.op.arg; if (src < seg || src >= seg + w) src = l; break;
        case K_SHFL_DOWN: src = l + t.op.arg; if (src >= seg + w) src = l; break;
        case K_SHFL_UP: src = l - t.op.arg; if (src < seg) src = l; break;
        default: break;
        }
        if (op.kind >= K_SHFL_IDX && op.kind <= K_SHFL_UP) {
            if (!(mask >> src & 1u))
                fail_locked(lock, format("%s (%s:%d): lane %d reads lane %d, which is not in mask 0x%08x",
                                         op.name, op.file, op.line, l, src, mask));
            t.result = b.threads[base + src].op.value;
        } else if (op.kind == K_BALLOT) {
            t.result = ballot;
        } else if (op.kind == K_ALL) {
            t.result = all;
        } else if (op.kind == K_ANY) {
            t.result = any;
        } else {
            t.result = 0;
        }
        t.state = RUNNABLE;
        --b.n_blocked;
    }
    if (b.mode == 1) b.wake.notify_all();
}

}  // namespace

ThreadInfo* current() { return &t_current->info; }

void* dynamic_shared() { return g_dynamic; }

[[noreturn]] void fail(const char* file, int line, const char* message) {
    Block& b = *g_block;
    Lock lock(b);
    fail_locked(lock, format("%s:%d: %s: %s", file, line, who(*t_current).c_str(), message));
}

void syncthreads(const char* file, int line) {
    Block& b = *g_block;
    Thread* self = t_current;
    Lock lock(b);
    if (b.failed) abandon(lock);
    if (b.n_done > 0)
        fail_locked(lock, format("divergent __syncthreads (%s:%d): %s reached it after %d thread(s) of "
                                 "the block returned without reaching it",
                                 file, line, who(*self).c_str(), b.n_done));
    if (b.n_barrier > 0 && (b.barrier_line != line || std::strcmp(b.barrier_file, file) != 0))
        fail_locked(lock, format("divergent __syncthreads: %s waits at %s:%d while %d thread(s) wait at %s:%d",
                                 who(*self).c_str(), file, line, b.n_barrier, b.barrier_file, b.barrier_line));
    self->state = BARRIER;
    self->file = file;
    self->line = line;
    if (b.n_barrier++ == 0) {
        b.barrier_file = file;
        b.barrier_line = line;
    }
    ++b.n_blocked;
    if (b.n_barrier == b.n) {
        for (Thread& t : b.threads) t.state = RUNNABLE;
        b.n_blocked -= b.n_barrier;
        b.n_barrier = 0;
        if (b.mode == 1) {
            b.wake.notify_all();
            return;
        }
    }
    wait_released(lock, BARRIER);
}

unsigned long long warp_collective(const WarpOp& op) {
    Block& b = *g_block;
    Thread* self = t_current;
    Lock lock(b);
    if (b.failed) abandon(lock);
    const int linear = self->info.linear, lane = linear & 31, base = linear - lane;
    const int lanes = std::min(32, b.n - base);
    const unsigned mask = op.mask;
    if (!(mask >> lane & 1u))
        fail_locked(lock, format("%s (%s:%d): %s (lane %d) is not in its own mask 0x%08x", op.name, op.file,
                                 op.line, who(*self).c_str(), lane, mask));
    if (op.width <= 0 || op.width > 32 || (op.width & (op.width - 1)) != 0)
        fail_locked(lock, format("%s (%s:%d): width %d is not a power of two <= 32", op.name, op.file, op.line,
                                 op.width));
    for (int l = 0; l < 32; ++l) {
        const bool in_mask = mask >> l & 1u;
        if (in_mask && l >= lanes)
            fail_locked(lock, format("%s (%s:%d): mask 0x%08x names lane %d, which does not exist (the block "
                                     "has %d threads)", op.name, op.file, op.line, mask, l, b.n));
        if (l >= lanes || l == lane) continue;
        const Thread& t = b.threads[base + l];
        if (in_mask && t.state == DONE)
            fail_locked(lock, format("%s (%s:%d): mask 0x%08x includes lane %d, which has returned (a warp "
                                     "collective after lanes returned)", op.name, op.file, op.line, mask, l));
        if (t.state == WARP && in_mask &&
            (t.op.mask != mask || t.op.kind != op.kind || t.op.width != op.width ||
             t.op.callback != op.callback))
            fail_locked(lock, format("warp lanes disagree: lane %d calls %s(mask=0x%08x) at %s:%d, lane %d "
                                     "waits in %s(mask=0x%08x) at %s:%d", lane, op.name, mask, op.file, op.line,
                                     l, t.op.name, t.op.mask, t.file, t.line));
    }
    self->op = op;
    self->state = WARP;
    self->file = op.file;
    self->line = op.line;
    ++b.n_blocked;
    bool complete = true;
    for (int l = 0; l < 32 && complete; ++l)
        if ((mask >> l & 1u) && b.threads[base + l].state != WARP) complete = false;
    if (complete) {
        finish_collective(lock, b, base, mask);
        return self->result;
    }
    wait_released(lock, WARP);
    return self->result;
}

namespace {

void thread_exit() {
    Block& b = *g_block;
    Thread* self = t_current;
    Lock lock(b);
    if (b.failed) abandon(lock);
    self->state = DONE;
    ++b.n_done;
    const int linear = self->info.linear, lane = linear & 31, base = linear - lane;
    for (int l = 0; l < 32 && base + l < b.n; ++l) {
        const Thread& t = b.threads[base + l];
        if (t.state == WARP && (t.op.mask >> lane & 1u))
            fail_locked(lock, format("%s (%s:%d): lane %d waits with mask 0x%08x, but lane %d returned without "
                                     "reaching it", t.op.name, t.file, t.line, l, t.op.mask, lane));
    }
    if (b.n_barrier > 0 && b.n_barrier + b.n_done == b.n)
        fail_locked(lock, format("divergent __syncthreads (%s:%d): %d thread(s) wait there but %d returned "
                                 "without reaching it", b.barrier_file, b.barrier_line, b.n_barrier, b.n_done));
    if (b.n_blocked > 0 && b.n_blocked + b.n_done == b.n) fail_locked(lock, describe_deadlock(b));
    if (b.mode == 1) b.wake.notify_all();
}

void fiber_main() {
    g_block->entry(g_block->args);
    thread_exit();
}  // returns to uc_link: the scheduler

void* os_thread_main(void* arg) {
    Thread* self = static_cast<Thread*>(arg);
    t_current = self;
    if (setjmp(self->exit_jump) == 0) {
        g_block->entry(g_block->args);
        thread_exit();
    }
    return nullptr;
}

unsigned long long splitmix(unsigned long long& s) {
    unsigned long long z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void fill_garbage(unsigned char* p, std::size_t n, unsigned long long seed) {
    for (std::size_t i = 0; i < n; i += 8) {
        unsigned long long g = splitmix(seed);
#if defined(__SANITIZE_ADDRESS__)
        // The static shared region holds AddressSanitizer's redzones: fill only the variables.
        for (std::size_t j = 0; j < 8 && i + j < n; ++j)
            if (!__asan_address_is_poisoned(p + i + j)) p[i + j] = static_cast<unsigned char>(g >> (8 * j));
#else
        std::memcpy(p + i, &g, std::min<std::size_t>(8, n - i));
#endif
    }
}

struct Stacks {
    std::vector<char*> base;
    std::size_t size = 0;
    ~Stacks() {
        for (char* p : base) munmap(p, size);
    }
    char* get(int i) {
        while (static_cast<int>(base.size()) <= i) {
            void* p = mmap(nullptr, kFiberStack, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) return nullptr;
            mprotect(p, 4096, PROT_NONE);  // guard page: a stack overflow faults
            base.push_back(static_cast<char*>(p));
            size = kFiberStack;
        }
        return base[i];
    }
};

bool run_block(Block& b, Stacks& stacks, const Launch& L, uint3 block_idx, unsigned long long shuffle_seed) {
    const unsigned bx = L.block[0], by = L.block[1];
    for (int i = 0; i < b.n; ++i) {
        Thread& t = b.threads[i];
        t.info.thread_idx = uint3{i % bx, (i / bx) % by, i / (bx * by)};
        t.info.block_idx = block_idx;
        t.info.block_dim = dim3(L.block[0], L.block[1], L.block[2]);
        t.info.grid_dim = dim3(L.grid[0], L.grid[1], L.grid[2]);
        t.info.linear = i;
        t.state = RUNNABLE;
        t.file = nullptr;
        t.line = 0;
    }
    b.n_barrier = b.n_blocked = b.n_done = 0;
    if (b.mode == 1) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, kThreadStack);
        int started = 0;
        for (; started < b.n; ++started)
            if (pthread_create(&b.threads[started].os_thread, &attr, os_thread_main, &b.threads[started]) != 0)
                break;
        pthread_attr_destroy(&attr);
        if (started < b.n) {
            Lock lock(b);
            b.failed = true;
            b.error = format("could not start %d OS threads (started %d)", b.n, started);
            lock.release();
            b.wake.notify_all();
        }
        for (int i = 0; i < started; ++i) pthread_join(b.threads[i].os_thread, nullptr);
        return !b.failed;
    }
    for (int i = 0; i < b.n; ++i) {
        Thread& t = b.threads[i];
        char* stack = stacks.get(i);
        if (stack == nullptr) {
            b.failed = true;
            b.error = "could not allocate fiber stacks";
            return false;
        }
        getcontext(&t.context);
        t.context.uc_stack.ss_sp = stack;
        t.context.uc_stack.ss_size = kFiberStack;
        t.context.uc_link = &b.scheduler;
        makecontext(&t.context, fiber_main, 0);
    }
    // Default: round-robin in thread order. Shuffled: warps in a random order, each
    // driven as far as it can go (to a barrier) before the next, lanes in random order.
    std::mt19937_64 rng(shuffle_seed);
    std::vector<int> runnable, warps;
    runnable.reserve(b.n);
    const int n_warps = (b.n + 31) / 32;
    for (int w = 0; w < n_warps; ++w) warps.push_back(w);
    auto run = [&](int i) {
        t_current = &b.threads[i];
        swapcontext(&b.scheduler, &b.threads[i].context);
        return !b.failed;
    };
    for (;;) {
        bool progressed = false;
        if (shuffle_seed == 0) {
            for (int i = 0; i < b.n; ++i) {
                if (b.threads[i].state != RUNNABLE) continue;
                progressed = true;
                if (!run(i)) return false;
            }
        } else {
            std::shuffle(warps.begin(), warps.end(), rng);
            for (int w : warps) {
                for (;;) {
                    runnable.clear();
                    for (int i = 32 * w; i < std::min(b.n, 32 * w + 32); ++i)
                        if (b.threads[i].state == RUNNABLE) runnable.push_back(i);
                    if (runnable.empty()) break;
                    progressed = true;
                    std::shuffle(runnable.begin(), runnable.end(), rng);
                    for (int i : runnable)
                        if (b.threads[i].state == RUNNABLE && !run(i)) return false;
                }
            }
        }
        if (!progressed) break;
    }
    if (b.n_done != b.n) {
        b.failed = true;
        b.error = describe_deadlock(b);
    }
    return !b.failed;
}

}  // namespace
}  // namespace cudacpu

extern "C" int cudacpu_launch(void (*entry)(void**), void** args, const cudacpu::Launch* launch,
                              char* error, unsigned long error_size) {
    using namespace cudacpu;
    std::lock_guard<std::mutex> guard(g_launch_mutex);
    const Launch& L = *launch;
    auto report = [&](const std::string& m) {
        std::snprintf(error, error_size, "%s", m.c_str());
        return 1;
    };
    const unsigned long long n = 1ull * L.block[0] * L.block[1] * L.block[2];
    if (n == 0 || n > 1024 || L.block[2] > 64)
        return report(format("invalid block (%u,%u,%u): 1..1024 threads, z <= 64", L.block[0], L.block[1],
                             L.block[2]));
    if (L.grid[0] == 0 || L.grid[1] == 0 || L.grid[2] == 0 || L.grid[1] > 65535 || L.grid[2] > 65535 ||
        L.grid[0] > 2147483647u)
        return report(format("invalid grid (%u,%u,%u)", L.grid[0], L.grid[1], L.grid[2]));
    if (L.shared_bytes > kMaxDynamicShared)
        return report(format("shared_mem=%llu exceeds the %llu bytes of dynamic shared memory a block may use",
                             L.shared_bytes, kMaxDynamicShared));
    Block b;
    b.n = static_cast<int>(n);
    b.threads.resize(b.n);
    b.mode = L.mode;
    b.entry = entry;
    b.args = args;
    g_block = &b;
    Stacks stacks;
    const unsigned long long blocks = 1ull * L.grid[0] * L.grid[1] * L.grid[2];
    std::vector<unsigned long long> order(blocks);
    for (unsigned long long i = 0; i < blocks; ++i) order[i] = i;
    if (L.shuffle_seed != 0) {
        std::mt19937_64 rng(L.shuffle_seed);
        std::shuffle(order.begin(), order.end(), rng);
    }
    unsigned char* shared_start = reinterpret_cast<unsigned char*>(__cudacpu_shared_start);
    const std::size_t static_bytes = static_cast<std::size_t>(__cudacpu_shared_end - __cudacpu_shared_start);
    CUDACPU_POISON(g_dynamic + L.shared_bytes, kMaxDynamicShared - L.shared_bytes);
    int rc = 0;
    for (unsigned long long k = 0; k < blocks; ++k) {
        const unsigned long long i = order[k];
        uint3 idx{static_cast<unsigned>(i % L.grid[0]), static_cast<unsigned>((i / L.grid[0]) % L.grid[1]),
                  static_cast<unsigned>(i / (1ull * L.grid[0] * L.grid[1]))};
        fill_garbage(shared_start, static_bytes, L.fill_seed * 0x100000001b3ull + i);
        fill_garbage(g_dynamic, L.shared_bytes, ~L.fill_seed + i * 0x9e3779b97f4a7c15ull);
        if (!run_block(b, stacks, L, idx, L.shuffle_seed == 0 ? 0 : L.shuffle_seed + i)) {
            rc = report(format("block (%u,%u,%u): %s", idx.x, idx.y, idx.z, b.error.c_str()));
            break;
        }
    }
    CUDACPU_UNPOISON(g_dynamic, kMaxDynamicShared);
    g_block = nullptr;
    return rc;
}
