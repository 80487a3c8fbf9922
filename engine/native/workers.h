// A small pool of worker threads for the native ops: a call's work is split into one contiguous
// share per thread, taken a chunk at a time; a thread done with its own share takes chunks
// from the back of the others'.
#pragma once

#include <functional>

namespace batchscope {

// Runs body(begin, end) over [0, count) in chunks of at most `chunk`, on the calling thread and
// the pool's workers together, and returns when all are done. Returns
// false without running anything when the pool is serving another caller or has no workers;
// the caller then does the work itself. Which thread runs a chunk must not change the result.
bool parallel_for(int count, int chunk, const std::function<void(int, int)>& body);

// Threads that can work at once: the caller plus the workers.
int parallel_threads();

}  // namespace batchscope
