/* The logits ops around the draw on the CPU: process_logits (penalties,
 * logit_bias, bans, grammar masks) and top_logprobs; the references for the
 * CUDA kernels (backend/sample.h states the semantics). */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/sample.h"

void kvs_cpu_process_logits(kvs_backend *b, void *out, int ld_out, const void *logits, int ld, int n_rows, int vocab,
                            const struct kvs_process_row *rows, const struct kvs_logit_adjust *adjust,
                            const uint32_t *masks) {
    const float *x = logits;
    float *y = out;
    int words = kvs_sample_mask_words(vocab);
#pragma omp parallel for schedule(dynamic, 1) if (n_rows > 1)
    for (int r = 0; r < n_rows; r++) {
        const kvs_process_row *q = &rows[r];
        const float *xr = x + (size_t)r * ld;
        float *yr = y + (size_t)r * ld_out;
        const uint32_t *mask = q->mask_row >= 0 ? masks + (size_t)q->mask_row * words : NULL;
        for (int i = 0; i < vocab; i++)
            yr[i] = isfinite(xr[i]) && mask && !(mask[i >> 5] >> (i & 31) & 1) ? KVS_SAMPLE_MASKED : xr[i];
        for (int e = q->adjust_begin; e < q->adjust_begin + q->adjust_count; e++) {
            int i = adjust[e].id;
            if (i >= 0 && i < vocab && isfinite(xr[i]) && yr[i] != KVS_SAMPLE_MASKED)
                yr[i] = kvs_sample_adjusted(xr[i], &adjust[e], q);
        }
    }
}

void kvs_cpu_top_logprobs(kvs_backend *b, float *chosen_lp, int32_t *top_ids, float *top_lp, const void *logits,
                          int n_rows, int ld, int vocab, const int32_t *chosen, int k) {
    const float *x = logits;
#pragma omp parallel for schedule(dynamic, 1) if (n_rows > 1)
    for (int r = 0; r < n_rows; r++) {
        const float *xr = x + (size_t)r * ld;
        float bx = xr[0];
        bool finite = true;
        for (int i = 0; i < vocab; i++) {
            finite &= isfinite(xr[i]) != 0;
            if (xr[i] > bx) bx = xr[i];
        }
        int32_t *ti = top_ids ? top_ids + (size_t)r * k : NULL;
        float *tl = top_lp ? top_lp + (size_t)r * k : NULL;
        if (!finite || chosen[r] < 0) {
            chosen_lp[r] = NAN;
            for (int j = 0; j < k; j++) ti[j] = -1, tl[j] = NAN;
            continue;
        }
        double sum = 0;
        for (int i = 0; i < vocab; i++) sum += exp((double)xr[i] - bx);
        double lse = bx + log(sum);
        chosen_lp[r] = (float)((double)xr[chosen[r]] - lse);
        /* the k best by insertion: ti/tl sorted, best first */
        int n = 0;
        for (int i = 0; k > 0 && i < vocab; i++) {
            if (n == k && !kvs_sample_ranks_before(xr[i], i, xr[ti[k - 1]], ti[k - 1])) continue;
            int j = n < k ? n++ : k - 1;
            while (j > 0 && kvs_sample_ranks_before(xr[i], i, xr[ti[j - 1]], ti[j - 1])) ti[j] = ti[j - 1], j--;
            ti[j] = i;
        }
        for (int j = 0; j < k; j++) {
            if (j >= n) ti[j] = -1;
            tl[j] = j < n ? (float)((double)xr[ti[j]] - lse) : -INFINITY;
        }
    }
}
