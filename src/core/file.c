#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

kvs_status kvs_map_file(const char *path, kvs_mapped_file *out) {
    out->data = NULL;
    out->size = 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return kvs_fail(KVS_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return kvs_fail(KVS_ERR_IO, "%s: not a regular file", path);
    }
    if (st.st_size == 0) {
        close(fd);
        return kvs_fail(KVS_ERR_FORMAT, "%s: file is empty", path);
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return kvs_fail(KVS_ERR_IO, "%s: mmap failed: %s", path, strerror(errno));
    out->data = p;
    out->size = (size_t)st.st_size;
    return KVS_OK;
}

void kvs_unmap_file(kvs_mapped_file *f) {
    if (f->data) munmap((void *)f->data, f->size);
    f->data = NULL;
    f->size = 0;
}

kvs_status kvs_read_file(const char *path, char **out, size_t *len) {
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) return kvs_fail(KVS_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t got = fread(buf + n, 1, cap - n - 1, fp);
        n += got;
        if (n + 1 < cap) break;
        char *bigger = realloc(buf, cap * 2);
        if (!bigger) { free(buf); buf = NULL; break; }
        buf = bigger;
        cap *= 2;
    }
    bool err = ferror(fp);
    fclose(fp);
    if (!buf) return kvs_fail(KVS_ERR_NOMEM, "%s: out of memory reading the file", path);
    if (err) { free(buf); return kvs_fail(KVS_ERR_IO, "%s: read error", path); }
    buf[n] = 0;
    *out = buf;
    if (len) *len = n;
    return KVS_OK;
}

bool kvs_file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

kvs_status kvs_path_join(char *dst, size_t cap, const char *dir, const char *name) {
    int n = snprintf(dst, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap) return kvs_fail(KVS_ERR_INVALID, "path too long: %s/%s", dir, name);
    return KVS_OK;
}
