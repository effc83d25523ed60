// splits.cuh -- which keys a split owns: the split-range contract of every decode kernel.
//
// The decode query of a sequence of `len` keys sits at its last key, so it sees keys
// [first, len): first = 0, or len - 1 - window_left under a sliding window.  Split-KV decode
// (Flash-Decoding) deals those keys to num_splits splits in contiguous runs of
// per_split = ceil((len - first) / num_splits) keys: split s owns
// [min(first + s * per_split, len), min(first + (s + 1) * per_split, len)); trailing splits
// may be empty (and then write LSE_s = -inf).  The CUDA kernels split key by key (granule 1);
// the NumPy lesson and the Numba kernels split whole tiles of Bc keys.  Both are
// iokernels/core/splits.py's split_range(len, num_splits, s, granule, start=first), written
// there once; tests/test_splits.py runs this header on the host against it.
#pragma once

// (first, n_begin, n_end): the first key the query sees, and the keys [n_begin, n_end) split
// `split` of `num_splits` owns among [first, len); window_left < 0: no window
__host__ __device__ __forceinline__ int3 decode_split_keys(int len, int window_left, int num_splits, int split) {
    const int first = window_left < 0 ? 0 : max(len - 1 - window_left, 0);
    const int per_split = (len - first + num_splits - 1) / num_splits;
    const int n_begin = min(first + split * per_split, len), n_end = min(n_begin + per_split, len);
    return make_int3(first, n_begin, n_end);
}
