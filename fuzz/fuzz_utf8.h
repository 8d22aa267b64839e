/* fuzz: a strict UTF-8 check (no overlongs, surrogates or code points past U+10FFFF)
 * for the targets whose output must be valid UTF-8. */
#ifndef KVS_FUZZ_UTF8_H
#define KVS_FUZZ_UTF8_H

#include <stdbool.h>
#include <stddef.h>

static bool fuzz_valid_utf8(const void *s, size_t n) {
    const unsigned char *p = s;
    for (size_t i = 0; i < n;) {
        int k = p[i] < 0x80 ? 1 : p[i] >= 0xC2 && p[i] <= 0xDF ? 2 : (p[i] >> 4) == 14 ? 3 : p[i] >= 0xF0 && p[i] <= 0xF4 ? 4 : 0;
        if (!k || i + k > n) return false;
        for (int j = 1; j < k; j++)
            if ((p[i + j] & 0xC0) != 0x80) return false;
        if (k == 3 && ((p[i] == 0xE0 && p[i + 1] < 0xA0) || (p[i] == 0xED && p[i + 1] > 0x9F))) return false;
        if (k == 4 && ((p[i] == 0xF0 && p[i + 1] < 0x90) || (p[i] == 0xF4 && p[i + 1] > 0x8F))) return false;
        i += (size_t)k;
    }
    return true;
}

#endif
