/* libFuzzer target: kvs_safetensors_parse on arbitrary bytes. */
#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

static kvs_status touch(void *ctx, const char *name, kvs_dtype dtype, int ndim, const int64_t *shape,
                        const void *data, size_t nbytes) {
    /* read the first and last byte of each tensor: offsets must lie inside the buffer */
    volatile uint8_t sink = 0;
    if (nbytes) sink ^= ((const uint8_t *)data)[0] ^ ((const uint8_t *)data)[nbytes - 1];
    for (int d = 0; d < ndim; d++) sink ^= (uint8_t)shape[d];
    (void)sink;
    (*(size_t *)ctx)++;
    return KVS_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t n = 0;
    kvs_safetensors_parse(data, size, "fuzz.safetensors", touch, &n);
    return 0;
}
