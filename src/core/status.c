#include "core/core.h"

#include <stdio.h>

static _Thread_local char last_error[1024];

kvs_status kvs_fail(kvs_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return code;
}

const char *kvs_last_error(void) { return last_error[0] ? last_error : "no error"; }

const char *kvs_status_name(kvs_status s) {
    switch (s) {
    case KVS_OK: return "ok";
    case KVS_ERR_IO: return "io error";
    case KVS_ERR_FORMAT: return "format error";
    case KVS_ERR_UNSUPPORTED: return "unsupported";
    case KVS_ERR_INVALID: return "invalid argument";
    case KVS_ERR_NOMEM: return "out of memory";
    case KVS_ERR_NOT_FOUND: return "not found";
    case KVS_ERR_INTERNAL: return "internal error";
    case KVS_ERR_BUSY: return "busy";
    }
    return "unknown status";
}
