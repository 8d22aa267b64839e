/* cli: a small RGB canvas for the PNG charts (bench serve --plot, calibrate
 * --plot): pixels, rectangles, lines, text in a built-in 5x7 bitmap font
 * (digits, capitals, a little punctuation; lower case drawn as capitals), and
 * the PNG file (libpng). */
#include <errno.h>
#include <math.h>
#include <png.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/plot_canvas.h"

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
    {'Y', {0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04}}, {'B', {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E}},
    {'J', {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}}, {'V', {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04}},
    {'W', {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A}}, {'X', {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11}},
    {'Z', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F}}, {'%', {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03}},
    {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}}, {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}},
    {':', {0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0}},          {',', {0, 0, 0, 0, 0x0C, 0x04, 0x08}},
    {'=', {0, 0, 0x1F, 0, 0x1F, 0, 0}},                {'+', {0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0}},
    {';', {0, 0x0C, 0x0C, 0, 0x0C, 0x04, 0x08}},       {'\'', {0x04, 0x04, 0x08, 0, 0, 0, 0}},
};

void kvs_canvas_put_px(kvs_canvas *c, int x, int y, uint32_t rgb) {
    if (x < 0 || y < 0 || x >= c->w || y >= c->h) return;
    uint8_t *p = c->px + ((size_t)y * c->w + x) * 3;
    p[0] = (uint8_t)(rgb >> 16), p[1] = (uint8_t)(rgb >> 8), p[2] = (uint8_t)rgb;
}

void kvs_canvas_rect(kvs_canvas *c, int x0, int y0, int x1, int y1, uint32_t rgb) {
    for (int y = y0; y <= y1; y++)
        for (int x = x0; x <= x1; x++) kvs_canvas_put_px(c, x, y, rgb);
}

void kvs_canvas_line(kvs_canvas *c, int x0, int y0, int x1, int y1, int thick, uint32_t rgb) {
    int dx = abs(x1 - x0), dy = -abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1, err = dx + dy;
    for (;;) {
        kvs_canvas_rect(c, x0 - thick / 2, y0 - thick / 2, x0 + (thick - 1) / 2, y0 + (thick - 1) / 2, rgb);
        if (x0 == x1 && y0 == y1) break;
        int e2 = 2 * err;
        if (e2 >= dy) err += dy, x0 += sx;
        if (e2 <= dx) err += dx, y0 += sy;
    }
}

/* Text at (x, y) top-left, scale s; align: 0 left, 1 centre, 2 right. */
void kvs_canvas_text(kvs_canvas *c, int x, int y, const char *s, int scale, int align, uint32_t rgb) {
    int w = (int)strlen(s) * 6 * scale;
    x -= align == 1 ? w / 2 : align == 2 ? w : 0;
    for (; *s; s++, x += 6 * scale) {
        char ch = *s >= 'a' && *s <= 'z' ? (char)(*s - 'a' + 'A') : *s; /* capitals only */
        for (size_t g = 0; g < sizeof glyphs / sizeof glyphs[0]; g++) {
            if (glyphs[g].c != ch) continue;
            for (int r = 0; r < 7; r++)
                for (int b = 0; b < 5; b++)
                    if (glyphs[g].rows[r] & (0x10 >> b))
                        kvs_canvas_rect(c, x + b * scale, y + r * scale, x + b * scale + scale - 1, y + r * scale + scale - 1, rgb);
        }
    }
}

double kvs_canvas_nice_max(double v) {
    if (!(v > 0)) return 1;
    double p = pow(10, floor(log10(v))), m = v / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
}

void kvs_canvas_number(char *buf, size_t cap, double v) {
    if (fabs(v) >= 100 || v == floor(v)) snprintf(buf, cap, "%.0f", v);
    else snprintf(buf, cap, "%.2g", v);
}

kvs_status kvs_canvas_create(kvs_canvas *c, int w, int h) {
    c->w = w, c->h = h;
    c->px = malloc((size_t)w * h * 3);
    if (!c->px) return kvs_fail(KVS_ERR_NOMEM, "plot: out of memory");
    memset(c->px, 0xFF, (size_t)w * h * 3);
    return KVS_OK;
}

kvs_status kvs_canvas_write_png(kvs_canvas *c, const char *path) {
    FILE *f = fopen(path, "wb");
    if (!f) return kvs_fail(KVS_ERR_IO, "plot: cannot write %s: %s", path, strerror(errno));
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    kvs_status st = KVS_OK;
    if (!png || !info || setjmp(png_jmpbuf(png))) {
        st = kvs_fail(KVS_ERR_IO, "plot: libpng failed writing %s", path);
    } else {
        png_init_io(png, f);
        png_set_IHDR(png, info, (png_uint_32)c->w, (png_uint_32)c->h, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
                     PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
        png_write_info(png, info);
        for (int y = 0; y < c->h; y++) png_write_row(png, c->px + (size_t)y * c->w * 3);
        png_write_end(png, NULL);
    }
    png_destroy_write_struct(&png, &info);
    if (fclose(f) != 0 && st == KVS_OK) st = kvs_fail(KVS_ERR_IO, "plot: cannot write %s: %s", path, strerror(errno));
    return st;
}

void kvs_canvas_free(kvs_canvas *c) {
    free(c->px);
    c->px = NULL;
}
