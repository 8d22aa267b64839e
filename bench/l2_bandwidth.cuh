/* kvs_bench_kernels [device] l2: global -> shared memory bandwidth from every SM, one CTA
 * a SM, 32 KiB chunks (a WGMMA prefill half-tile) two in flight, the way the prefill's
 * producer reads K/V: by 16-byte cp.async from 128 threads (as the producer warpgroup
 * does) and by bulk copies (cp.async.bulk, the TMA engine, 4 KiB a copy: one 16-key
 * unit of a paged block at head_dim 128) issued by one thread. Regions of 8 MiB (a KV
 * group's K and V at 16k tokens: L2-resident), 48 MiB and 1 GiB (HBM); each CTA walks
 * the region from its own start. Bytes landed in shared memory per second, all SMs.
 * docs/CUDA.md "Where a tile's time goes" reads it against the prefill's demand. */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
#define L2BW_CHUNK 32768
#define L2BW_SMEM (4 * L2BW_CHUNK) /* > 1/2 of the SM: one CTA a SM */

static __global__ void l2bw_cp_async(const uint8_t *src, size_t region, int iters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char l2bw_smem[];
    const uint32_t base = kvs_smem_u32(l2bw_smem);
    const size_t n_chunks = region / L2BW_CHUNK;
    auto issue = [&](int it) {
        const uint8_t *s = src + ((blockIdx.x * 7919ull + it) % n_chunks) * L2BW_CHUNK;
        const uint32_t d = base + (uint32_t)(it % 2) * L2BW_CHUNK;
#pragma unroll
        for (int k = 0; k < L2BW_CHUNK / 16 / 128; k++) {
            const int off = (k * 128 + threadIdx.x) * 16;
            kvs_cp_async16(d + off, s + off, true);
        }
        kvs_cp_async_commit();
    };
    issue(0);
    for (int it = 0; it < iters; it++) {
        if (it + 1 < iters) issue(it + 1);
        else kvs_cp_async_commit();
        kvs_cp_async_wait<1>();
        __syncthreads(); /* chunk it landed for every thread: its buffer is free again */
    }
#endif
}

static __global__ void l2bw_bulk(const uint8_t *src, size_t region, int iters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char l2bw_smem[];
    const uint32_t base = kvs_smem_u32(l2bw_smem), bars = base + 2 * L2BW_CHUNK;
    if (threadIdx.x != 0) return;
    kvs_mbar_init(bars, 1), kvs_mbar_init(bars + 8, 1);
    kvs_mbar_init_fence();
    const size_t n_chunks = region / L2BW_CHUNK;
    auto issue = [&](int it) {
        const uint8_t *s = src + ((blockIdx.x * 7919ull + it) % n_chunks) * L2BW_CHUNK;
        const uint32_t d = base + (uint32_t)(it % 2) * L2BW_CHUNK, bar = bars + 8 * (it % 2);
        kvs_mbar_arrive_tx(bar, L2BW_CHUNK);
#pragma unroll
        for (int k = 0; k < L2BW_CHUNK / 4096; k++)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];\n" ::"r"(
                             d + 4096 * k),
                         "l"(s + 4096 * k), "r"(bar)
                         : "memory");
    };
    issue(0);
    for (int it = 0; it < iters; it++) {
        if (it + 1 < iters) issue(it + 1);
        kvs_mbar_wait(bars + 8 * (it % 2), (it / 2) & 1);
    }
#endif
}

struct l2bw_ctx {
    const uint8_t *src;
    size_t region;
    int iters, sms;
    bool bulk;
};
static void run_l2bw(kvs_backend *b, void *p) {
    l2bw_ctx *c = (l2bw_ctx *)p;
    cudaStream_t st = kvs_cuda_of(b)->stream;
    if (c->bulk) l2bw_bulk<<<c->sms, 32, L2BW_SMEM, st>>>(c->src, c->region, c->iters);
    else l2bw_cp_async<<<c->sms, 128, L2BW_SMEM, st>>>(c->src, c->region, c->iters);
}

static bool bench_l2_bandwidth(kvs_backend *b, int sms) {
    cudaFuncSetAttribute(l2bw_cp_async, cudaFuncAttributeMaxDynamicSharedMemorySize, L2BW_SMEM);
    cudaFuncSetAttribute(l2bw_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, L2BW_SMEM);
    const size_t big = (size_t)1 << 30;
    uint8_t *src = (uint8_t *)b->alloc(b, big);
    if (!src) return false;
    cudaMemsetAsync(src, 1, big, kvs_cuda_of(b)->stream);
    const size_t regions[3] = {(size_t)8 << 20, (size_t)48 << 20, big};
    for (size_t r : regions) {
        for (int bulk = 0; bulk < 2; bulk++) {
            l2bw_ctx c = {src, r, 2048, sms, bulk != 0};
            const double t = time_it(b, 5, run_l2bw, &c);
            printf("l2: %5zu MiB region, %-38s %7.0f GB/s into shared memory (%d SMs)\n", r >> 20,
                   bulk ? "bulk copies of 4 KiB (one thread)" : "16-byte cp.async (128 threads)",
                   (double)sms * c.iters * L2BW_CHUNK / t / 1e9, sms);
        }
    }
    b->free(b, src);
    return kvs_cuda_of(b)->failed == 0;
}
#endif
