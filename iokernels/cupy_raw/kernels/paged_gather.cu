// paged_gather.cu -- copy one sequence's K and V out of a paged pool into contiguous
// (heads_kv, seq, head_dim) arrays (PagedAttention's block table, read on the GPU).
//
// The kernel does not care about the dtype: a row of head_dim elements is moved as
// CHUNKS_PER_ROW chunks of CHUNK_BYTES bytes (16 when the row is a whole number of
// 16-byte pieces: one vector load and one vector store each; else the element size).
// Thread i writes output chunk i, so stores are fully coalesced; its source is found
// through the block table: token n lives in block table[n / BLOCK_SIZE], row n % BLOCK_SIZE.
//
// Compile-time settings: BLOCK_SIZE, CHUNK_BYTES (16, 8, 4 or 2), CHUNKS_PER_ROW.
#if PAGED && !defined(BLOCK_SIZE)
#error "paged_gather.cu: -DBLOCK_SIZE is missing (cupy_raw/gather.py passes it for a paged cache)"
#endif
#ifndef CHUNK_BYTES
#error "paged_gather.cu: -DCHUNK_BYTES is missing (cupy_raw/gather.py passes it)"
#endif
#ifndef CHUNKS_PER_ROW
#error "paged_gather.cu: -DCHUNKS_PER_ROW is missing (cupy_raw/gather.py passes it)"
#endif

#if CHUNK_BYTES == 16
typedef uint4 chunk_t;
#elif CHUNK_BYTES == 8
typedef unsigned long long chunk_t;
#elif CHUNK_BYTES == 4
typedef unsigned int chunk_t;
#else
typedef unsigned short chunk_t;
#endif

// pool: (num_blocks, BLOCK_SIZE, heads_kv, head_dim) contiguous; out: (heads_kv, seq_len, head_dim)
extern "C" __global__ void paged_gather(const chunk_t* __restrict__ k_pool, const chunk_t* __restrict__ v_pool,
                                        const int* __restrict__ block_table, int seq_len, int heads_kv,
                                        chunk_t* __restrict__ k_out, chunk_t* __restrict__ v_out) {
    const long long total = (long long)heads_kv * seq_len * CHUNKS_PER_ROW;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(i % CHUNKS_PER_ROW);
        const long long hn = i / CHUNKS_PER_ROW;     // = h * seq_len + n
        const int n = (int)(hn % seq_len), h = (int)(hn / seq_len);
        const long long blk = block_table[n / BLOCK_SIZE];
        const long long src = ((blk * BLOCK_SIZE + n % BLOCK_SIZE) * heads_kv + h) * CHUNKS_PER_ROW + c;
        k_out[i] = k_pool[src];                      // read one chunk of K from its block; write in place
        v_out[i] = v_pool[src];
    }
}
