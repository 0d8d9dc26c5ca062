#include "cpu/thread_pool.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace jflash::cpu {
namespace {

constexpr long kMaxThreads = 1024;

// Threads in all (workers + the calling thread): JFLASH_CPU_THREADS when it is
// an integer in [1, kMaxThreads], else std::thread::hardware_concurrency().
// jflash/_src/ffi.py rejects other values at import with a ValueError, so the
// fallback only serves a library loaded without the Python package.
int PoolThreads() {
  if (const char* text = std::getenv("JFLASH_CPU_THREADS"); text != nullptr) {
    char* end = nullptr;
    errno = 0;
    const long n = std::strtol(text, &end, 10);
    if (errno == 0 && end != text && *end == '\0' && n >= 1 && n <= kMaxThreads) {
      return static_cast<int>(n);
    }
  }
  const unsigned threads = std::thread::hardware_concurrency();
  return threads > 0 ? static_cast<int>(threads) : 1;
}

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads) {
    for (int i = 1; i < num_threads; ++i) {
      workers_.emplace_back([this] { WorkerLoop(); });
      // Named so that tools (and the tests) can tell the pool's threads apart.
      pthread_setname_np(workers_.back().native_handle(), "jflash-cpu");
    }
  }

  void ParallelFor(int64_t count, const std::function<void(int64_t)>& body) {
    if (count <= 0) return;
    // One job at a time: XLA may run two jflash custom calls concurrently.
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    if (count == 1 || workers_.empty()) {
      for (int64_t i = 0; i < count; ++i) body(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      body_ = &body;
      count_ = count;
      next_.store(0, std::memory_order_relaxed);
      busy_workers_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    RunTasks(body, count);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return busy_workers_ == 0; });
    body_ = nullptr;
  }

 private:
  void RunTasks(const std::function<void(int64_t)>& body, int64_t count) {
    for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < count;
         i = next_.fetch_add(1, std::memory_order_relaxed)) {
      body(i);
    }
  }

  void WorkerLoop() {
    uint64_t seen_generation = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen_generation; });
      seen_generation = generation_;
      const std::function<void(int64_t)>& body = *body_;
      const int64_t count = count_;
      lock.unlock();
      RunTasks(body, count);
      lock.lock();
      if (--busy_workers_ == 0) done_.notify_one();
    }
  }

  std::mutex job_mutex_;
  std::mutex mutex_;  // guards the job description below and busy_workers_
  std::condition_variable wake_;
  std::condition_variable done_;
  uint64_t generation_ = 0;
  const std::function<void(int64_t)>* body_ = nullptr;
  int64_t count_ = 0;
  std::atomic<int64_t> next_{0};
  int busy_workers_ = 0;
  std::vector<std::thread> workers_;
};

ThreadPool& Pool() {
  // Pools are never destroyed: workers stay parked in WorkerLoop until the
  // process exits, and joining them from a static destructor would race with
  // exit(). A forked child inherits the pool but none of its threads, so it
  // gets a pool of its own instead of waiting forever for workers that are gone.
  static std::mutex mutex;
  static ThreadPool* pool = nullptr;
  static pid_t pool_pid = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (pool == nullptr || pool_pid != getpid()) {
    pool = new ThreadPool(PoolThreads());
    pool_pid = getpid();
  }
  return *pool;
}

}  // namespace

void parallel_for(int64_t count, const std::function<void(int64_t)>& body) {
  Pool().ParallelFor(count, body);
}

int pool_threads() {
  static const int threads = PoolThreads();
  return threads;
}

float* thread_scratch(size_t floats) {
  constexpr size_t kAlignFloats = 64 / sizeof(float);
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats + kAlignFloats) buffer.resize(floats + kAlignFloats);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((address + 63) & ~uintptr_t{63});
}

}  // namespace jflash::cpu
