// The CPU kernels' own persistent worker pool.
//
// Created on first use with N threads in all: N - 1 workers that sleep between
// jobs, plus the thread that calls parallel_for, which works on the job instead
// of idling. N is the environment variable JFLASH_CPU_THREADS (1 to 1024, read
// once per process) or else std::thread::hardware_concurrency(). XLA's FFI
// thread pool is deliberately not used: the kernels then parallelize the same
// way however XLA was configured, and a job never waits behind unrelated XLA
// work queued on that pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace jflash::cpu {

// Calls body(i) for every i in [0, count) on the pool and returns once every
// call has returned. Indices are handed out dynamically in increasing order, so
// which thread runs which index varies from call to call: each body(i) must own
// its outputs and not depend on that (the kernels do, so results are
// deterministic). Concurrent callers are served one job at a time. body must
// not throw and must not call parallel_for itself.
void parallel_for(int64_t count, const std::function<void(int64_t)>& body);

// The pool's threads in all, the calling thread included (JFLASH_CPU_THREADS,
// else the logical CPUs): what parallel_for spreads a job over.
int pool_threads();

// At least `floats` float32s of 64-byte aligned scratch private to the calling
// thread, kept and reused across calls: the O(block) working memory of one task.
// Contents are unspecified; the pointer is valid until this thread's next call.
float* thread_scratch(size_t floats);

}  // namespace jflash::cpu
