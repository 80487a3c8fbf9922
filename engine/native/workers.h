// A small pool of worker threads for the native ops: a call's work is split into chunks that
// the calling thread and the workers take from a shared counter.
#pragma once

#include <functional>

namespace batchscope {

// Runs body(begin, end) over [0, count) in chunks of `chunk` (the last may be shorter), on the
// calling thread and the pool's workers together, and returns when all are done. Returns
// false without running anything when the pool is serving another caller or has no workers;
// the caller then does the work itself. Which thread runs a chunk must not change the result.
bool parallel_for(int count, int chunk, const std::function<void(int, int)>& body);

// Threads that can work at once: the caller plus the workers.
int parallel_threads();

}  // namespace batchscope
