// ParallelFor for the native FFI handlers: independent units spread over XLA's intra-op threads.
#ifndef RL_JAX_OPS_NATIVE_PARALLEL_FOR_H_
#define RL_JAX_OPS_NATIVE_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace rl_jax_native {

// Runs body(state, start, stop) over [0, units) in claims of a few units, on the calling thread
// and on up to num_threads - 1 tasks of `pool`; each participant makes its own scratch `state`
// with make_state() once it has claimed work. The caller claims too, so it finishes alone if no
// task ever runs (a busy or absent pool), and it returns once every unit is done. A task that
// starts later finds nothing to claim and touches nothing: the shared counters live as long as
// the last task, and a claim (the only path to `body` and `make_state`, and to whatever they
// reference) can only succeed while the caller still waits.
template <typename MakeState, typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t units, MakeState make_state, Body body) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_claim = std::max<int64_t>(1, units / (4 * threads));  // balance, few claims
  auto run = [shared, units, per_claim, make_state, body]() {
    std::optional<decltype(make_state())> state;
    for (;;) {
      const int64_t start = shared->next.fetch_add(per_claim);
      if (start >= units) return;
      if (!state) state.emplace(make_state());
      const int64_t stop = std::min(units, start + per_claim);
      body(*state, start, stop);
      shared->done.fetch_add(stop - start, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads && per_claim < units; ++t) {
    auto task = run;  // Schedule takes ownership of a copy
    pool.Schedule(std::move(task));
  }
  run();
  while (shared->done.load(std::memory_order_acquire) < units) std::this_thread::yield();
}

}  // namespace rl_jax_native

#endif  // RL_JAX_OPS_NATIVE_PARALLEL_FOR_H_
