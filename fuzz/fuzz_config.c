/* libFuzzer target: kvs_config_parse on arbitrary bytes (quantization_config included),
 * then the derived sizes. */
#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvs_config cfg;
    if (kvs_config_parse((const char *)data, size, "config.json", &cfg) != KVS_OK) return 0;
    /* an FP8 checkpoint's config (quantization_config) always runs as --quantization fp8 */
    if (cfg.ckpt_quant.fp8 != (cfg.quantization == KVS_QUANT_FP8) || cfg.ckpt_quant.method[sizeof cfg.ckpt_quant.method - 1])
        __builtin_trap();
    /* a config that parses must give sizes without overflow (UBSan watches) */
    volatile int64_t p = kvs_config_param_count(&cfg);
    volatile size_t kv = kvs_config_kv_bytes_per_token(&cfg, KVS_F32);
    for (int k = 0; k < KVS_W_KIND_COUNT; k++) {
        int64_t shape[2];
        int ndim;
        char name[160];
        kvs_weight_name((kvs_weight_kind)k, cfg.n_layers - 1, name, sizeof name);
        kvs_weight_expected(&cfg, (kvs_weight_kind)k, shape, &ndim);
    }
    (void)p;
    (void)kv;
    return 0;
}
