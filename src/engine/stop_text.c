/* engine: stop strings over streamed text (request.c's pending text). Lengths
 * throughout: the text may hold NUL bytes (a token for the byte 0x00), and a
 * stop string after one still matches. */
#define _GNU_SOURCE /* memmem */
#include <string.h>

#include "engine/engine_internal.h"

size_t kvs_stop_sendable(const char *const *stops, int n_stops, const char *text, size_t len, bool final,
                         bool *stopped) {
    *stopped = false;
    size_t send = len;
    for (int i = 0; i < n_stops; i++) { /* the earliest occurrence of any stop string */
        const char *hit = memmem(text, len, stops[i], strlen(stops[i]));
        if (hit && (size_t)(hit - text) < send) {
            send = (size_t)(hit - text);
            *stopped = true;
        }
    }
    if (*stopped || final) return send;
    size_t hold = 0; /* the longest tail that is the start of a stop string */
    for (int i = 0; i < n_stops; i++) {
        size_t sl = strlen(stops[i]);
        for (size_t k = sl - 1 < len ? sl - 1 : len; k > hold; k--)
            if (!memcmp(text + len - k, stops[i], k)) {
                hold = k;
                break;
            }
    }
    return len - hold;
}
