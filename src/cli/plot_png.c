/* cli: a small PNG line chart for `kvsparse bench serve --plot` (libpng):
 * one panel per series against a shared x axis, with ticks and labels drawn
 * in a built-in 5x7 bitmap font (digits, '.', '/', '-' and capitals). */
#include <math.h>
#include <png.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/plot_png.h"

typedef struct {
    uint8_t *px;
    int w, h;
} canvas;

static const struct {
    char c;
    uint8_t rows[7];
} glyphs[] = {
    {'0', {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}}, {'1', {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E}},
    {'2', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}}, {'3', {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E}},
    {'4', {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}}, {'5', {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E}},
    {'6', {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}}, {'7', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}},
    {'8', {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}}, {'9', {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}},
    {'.', {0, 0, 0, 0, 0, 0x0C, 0x0C}},                {'/', {0x01, 0x01, 0x02, 0x04, 0x08, 0x10, 0x10}},
    {'-', {0, 0, 0, 0x1F, 0, 0, 0}},                   {'A', {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}},
    {'C', {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E}}, {'D', {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C}},
    {'E', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F}}, {'F', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10}},
    {'G', {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F}}, {'H', {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}},
    {'I', {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}}, {'K', {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}},
    {'L', {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F}}, {'M', {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11}},
    {'N', {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11}}, {'O', {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}},
    {'P', {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10}}, {'Q', {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D}},
    {'R', {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11}}, {'S', {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E}},
    {'T', {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}}, {'U', {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}},
    {'Y', {0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04}},
};

static void put_px(canvas *c, int x, int y, uint32_t rgb) {
    if (x < 0 || y < 0 || x >= c->w || y >= c->h) return;
    uint8_t *p = c->px + ((size_t)y * c->w + x) * 3;
    p[0] = (uint8_t)(rgb >> 16), p[1] = (uint8_t)(rgb >> 8), p[2] = (uint8_t)rgb;
}

static void rect(canvas *c, int x0, int y0, int x1, int y1, uint32_t rgb) {
    for (int y = y0; y <= y1; y++)
        for (int x = x0; x <= x1; x++) put_px(c, x, y, rgb);
}

static void line(canvas *c, int x0, int y0, int x1, int y1, int thick, uint32_t rgb) {
    int dx = abs(x1 - x0), dy = -abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1, err = dx + dy;
    for (;;) {
        rect(c, x0 - thick / 2, y0 - thick / 2, x0 + (thick - 1) / 2, y0 + (thick - 1) / 2, rgb);
        if (x0 == x1 && y0 == y1) break;
        int e2 = 2 * err;
        if (e2 >= dy) err += dy, x0 += sx;
        if (e2 <= dx) err += dx, y0 += sy;
    }
}

/* Text at (x, y) top-left, scale s; align: 0 left, 1 centre, 2 right. */
static void text(canvas *c, int x, int y, const char *s, int scale, int align, uint32_t rgb) {
    int w = (int)strlen(s) * 6 * scale;
    x -= align == 1 ? w / 2 : align == 2 ? w : 0;
    for (; *s; s++, x += 6 * scale) {
        for (size_t g = 0; g < sizeof glyphs / sizeof glyphs[0]; g++) {
            if (glyphs[g].c != *s) continue;
            for (int r = 0; r < 7; r++)
                for (int b = 0; b < 5; b++)
                    if (glyphs[g].rows[r] & (0x10 >> b))
                        rect(c, x + b * scale, y + r * scale, x + b * scale + scale - 1, y + r * scale + scale - 1, rgb);
        }
    }
}

static double nice_max(double v) {
    if (!(v > 0)) return 1;
    double p = pow(10, floor(log10(v))), m = v / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
}

static void number(char *buf, size_t cap, double v) {
    if (fabs(v) >= 100 || v == floor(v)) snprintf(buf, cap, "%.0f", v);
    else snprintf(buf, cap, "%.2g", v);
}

static void panel(canvas *c, int ox, int oy, int w, int h, const char *title, const char *xlabel, const double *x,
                  const double *y, int n, uint32_t color) {
    int left = ox + 80, right = ox + w - 20, top = oy + 50, bottom = oy + h - 60;
    double xmin = x[0], xmax = x[0], ymax = 0;
    for (int i = 0; i < n; i++) {
        xmin = fmin(xmin, x[i]), xmax = fmax(xmax, x[i]);
        if (isfinite(y[i])) ymax = fmax(ymax, y[i]);
    }
    if (xmax == xmin) xmin -= 1, xmax += 1;
    ymax = nice_max(ymax * 1.05);
    text(c, (left + right) / 2, oy + 15, title, 2, 1, 0x202020);
    char buf[32];
    for (int t = 0; t <= 5; t++) {
        int py = bottom - (bottom - top) * t / 5;
        line(c, left, py, right, py, 1, 0xDDDDDD);
        number(buf, sizeof buf, ymax * t / 5);
        text(c, left - 8, py - 7, buf, 2, 2, 0x404040);
    }
    for (int i = 0; i < n; i++) {
        int px = left + (int)((x[i] - xmin) / (xmax - xmin) * (right - left));
        line(c, px, bottom, px, bottom + 5, 1, 0x404040);
        number(buf, sizeof buf, x[i]);
        text(c, px, bottom + 10, buf, 2, 1, 0x404040);
    }
    line(c, left, top, left, bottom, 2, 0x404040);
    line(c, left, bottom, right, bottom, 2, 0x404040);
    text(c, (left + right) / 2, oy + h - 25, xlabel, 2, 1, 0x202020);
    int px0 = 0, py0 = 0;
    for (int i = 0; i < n; i++) {
        if (!isfinite(y[i])) continue;
        int px = left + (int)((x[i] - xmin) / (xmax - xmin) * (right - left));
        int py = bottom - (int)(y[i] / ymax * (bottom - top));
        if (i > 0) line(c, px0, py0, px, py, 3, color);
        rect(c, px - 4, py - 4, px + 4, py + 4, color);
        px0 = px, py0 = py;
    }
}

kvs_status kvs_plot_png(const char *path, const char *xlabel, const double *x, int n, const kvs_plot_series *series,
                        int n_series) {
    if (n < 1 || n_series < 1) return kvs_fail(KVS_ERR_INVALID, "plot: nothing to draw");
    canvas c = {NULL, 520 * n_series, 420};
    c.px = malloc((size_t)c.w * c.h * 3);
    if (!c.px) return kvs_fail(KVS_ERR_NOMEM, "plot: out of memory");
    memset(c.px, 0xFF, (size_t)c.w * c.h * 3);
    static const uint32_t colors[] = {0x1F77B4, 0xD62728, 0x2CA02C, 0x9467BD};
    for (int s = 0; s < n_series; s++)
        panel(&c, 520 * s, 0, 520, 420, series[s].name, xlabel, x, series[s].y, n, colors[s % 4]);
    FILE *f = fopen(path, "wb");
    if (!f) {
        free(c.px);
        return kvs_fail(KVS_ERR_IO, "plot: cannot write %s", path);
    }
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    kvs_status st = KVS_OK;
    if (!png || !info || setjmp(png_jmpbuf(png))) {
        st = kvs_fail(KVS_ERR_IO, "plot: libpng failed writing %s", path);
    } else {
        png_init_io(png, f);
        png_set_IHDR(png, info, (png_uint_32)c.w, (png_uint_32)c.h, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
                     PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
        png_write_info(png, info);
        for (int y = 0; y < c.h; y++) png_write_row(png, c.px + (size_t)y * c.w * 3);
        png_write_end(png, NULL);
    }
    png_destroy_write_struct(&png, &info);
    fclose(f);
    free(c.px);
    return st;
}
