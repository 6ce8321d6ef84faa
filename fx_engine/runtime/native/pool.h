// Part of fx-engine's native kernels: the thread pool every kernel parallelizes over (dynamic chunk claiming).
// Not a standalone header: kernels.cpp includes the kernel families in order, inside its
// anonymous namespace, as one translation unit (one compile, everything inlinable).
#pragma once

// ---------------------------------------------------------------- thread pool
// A small persistent pool with dynamic chunk claiming. The calling thread (MLX's CPU
// stream thread) claims chunks too and never waits for a worker that has not started:
// it only waits for chunks already claimed. This matters on a small machine where BLAS
// threads or other processes may hold the other cores (a statically split job then waits
// a whole scheduler time slice for a descheduled worker). Workers spin briefly after each
// job (the next kernel usually follows within microseconds), then sleep on a futex.
//
// Which thread computes a chunk never changes its result: every output element is
// computed entirely inside one chunk.
class Pool {
 public:
  explicit Pool(int n) { resize(n); }
  ~Pool() { stop(); }

  int size() const { return n_; }

  void resize(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    stop();
    n_ = std::max(1, n);
    quit_.store(false);
    const uint64_t g0 = gen_.load();  // read before the threads start: no job can be missed
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, g0] { loop(g0); });
  }

  // Run f(c) for every chunk c in [0, chunks).
  void run(int chunks, const std::function<void(int)>& f) {
    if (chunks <= 0) return;
    if (chunks == 1 || n_ == 1) {
      for (int c = 0; c < chunks; ++c) f(c);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);  // one job at a time (several CPU streams)
    const uint32_t id = ++jobs_;  // 32 bits: the id lives in the high half of state_
    job_.store(&f, std::memory_order_relaxed);
    nchunks_.store(static_cast<uint32_t>(chunks), std::memory_order_relaxed);
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    state_.store(static_cast<uint64_t>(id) << 32, std::memory_order_release);
    gen_.fetch_add(1, std::memory_order_release);
    gen_.notify_all();
    work(id);
    for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      if (spins < 100000) pause(); else std::this_thread::yield();  // a claimed chunk's
    }                                                                // thread may be descheduled
    // Close the job before its function and counters can be reused: a late worker's
    // claim on this id now fails.
    state_.store((static_cast<uint64_t>(id) << 32) | CLOSED, std::memory_order_release);
    if (error_) std::rethrow_exception(error_);  // e.g. bad_alloc in a chunk
  }

 private:
  static constexpr uint64_t CLOSED = 0xFFFFFFFFull;

  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // Claim and run chunks of job `id` until none are left. A chunk that throws still
  // counts as done (the caller must not return while others run its function); the
  // first exception is rethrown by run().
  void work(uint32_t id) {
    while (true) {
      uint64_t cur = state_.load(std::memory_order_acquire);
      if (static_cast<uint32_t>(cur >> 32) != id) return;
      const uint64_t c = cur & 0xFFFFFFFFull;
      const std::function<void(int)>* f = job_.load(std::memory_order_relaxed);
      const uint32_t n = nchunks_.load(std::memory_order_relaxed);
      if (c >= n) return;
      if (state_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel)) {
        try {
          (*f)(static_cast<int>(c));
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mu_);
          if (!error_) error_ = std::current_exception();
        }
        done_.fetch_add(1, std::memory_order_acq_rel);
      }
    }
  }

  void loop(uint64_t seen) {
    while (true) {
      uint64_t g;
      int spins = 0;
      while ((g = gen_.load(std::memory_order_acquire)) == seen && spins < 4000) {
        pause();
        ++spins;
      }
      if (g == seen) {
        gen_.wait(seen);
        continue;
      }
      seen = g;
      if (quit_.load()) return;
      work(static_cast<uint32_t>(state_.load(std::memory_order_acquire) >> 32));
    }
  }

  void stop() {
    if (workers_.empty()) return;
    quit_.store(true);
    gen_.fetch_add(1);
    gen_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::atomic<int> n_{1};  // read by run() without the lock
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<uint64_t> state_{CLOSED};
  std::atomic<int> done_{0};
  std::atomic<bool> quit_{false};
  // Written before state_ publishes a job (release) and read after it is seen (acquire);
  // atomics only so that a late worker's read of a newer job's values is not a data race
  // (its claim then fails on the job id).
  std::atomic<const std::function<void(int)>*> job_{nullptr};
  std::atomic<uint32_t> nchunks_{0};
  uint32_t jobs_ = 0;
  std::mutex mu_, error_mu_;
  std::exception_ptr error_;
};

Pool& pool() {
  // Never destroyed: a static destructor at exit could race with MLX's stream thread.
  static Pool* p = new Pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  return *p;
}

// Blocks per chunk for the few-row (decode) paths, which stream each weight matrix once:
// at least `base` (the old ~2304 weights of K), and long enough runs that each thread gets
// about 4 chunks of consecutive blocks, rounded up to a multiple of `unit`. Each block
// prefetches the next block's rows while it computes; with one-block chunks the threads
// alternate blocks, and every prefetch warms the caches of the core that does not use it.
inline int stream_chunk(int blocks, int base, int unit = 1) {
  const int runs = 4 * pool().size();
  const int per = std::max(base, (blocks + runs - 1) / runs);
  return (per + unit - 1) / unit * unit;
}
