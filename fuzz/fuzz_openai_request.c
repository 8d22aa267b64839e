/* libFuzzer target: the OpenAI request parser/validator on arbitrary bytes
 * (both endpoints), and the response builders on arbitrary (maybe invalid
 * UTF-8) generated text. No engine or model needed. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"
#include "server/server_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int mode = data[0] % 3;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    if (mode < 2) {
        kvs_api_limits lim = {8192, 4096, 8};
        kvs_api_request r;
        kvs_api_error e;
        if (kvs_api_parse_request(body, len, mode ? KVS_API_CHAT : KVS_API_COMPLETIONS, &lim, &r, &e)) {
            /* a valid request satisfies what the engine is promised */
            if (r.max_tokens < 0 || r.max_tokens > lim.max_model_len || r.n_stop > KVS_MAX_STOP_STRINGS ||
                r.sampling.temperature < 0 || (r.kind == KVS_API_COMPLETIONS && !r.prompt && !r.prompt_ids) ||
                (r.kind == KVS_API_CHAT && r.n_messages < 1))
                abort();
            for (int i = 0; i < r.n_prompt_ids; i++)
                if (r.prompt_ids[i] < 0 || r.prompt_ids[i] >= lim.vocab_size) abort();
            kvs_api_request_free(&r);
        } else {
            if (e.http_status < 400 || e.http_status > 599 || !e.message[0]) abort();
            free(kvs_api_error_json(&e));
        }
        return 0;
    }
    int32_t ids[4] = {1, 2, 3, 4};
    float lps[4] = {-0.1f, -1.0f, -2.0f, -3.0f};
    kvs_resp_meta m = {len % 2 ? KVS_API_CHAT : KVS_API_COMPLETIONS, "cmpl-x", "m", 0, NULL, true, 2, len % 4 < 2};
    kvs_resp_slice s = {body, len, ids, lps, 4, 0, .finish = KVS_FINISH_STOP};
    kvs_resp_kv kv = {"snapkv", 2.5, 3, 100};
    free(kvs_resp_full(&m, &s, 1, 3, 4, len % 3 ? &kv : NULL));
    s.finish = KVS_FINISH_NONE;
    free(kvs_resp_chunk(&m, &s, true, true));
    return 0;
}
