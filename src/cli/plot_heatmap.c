/* cli: a PNG heatmap (calibrate --plot's attention by layer and position):
 * rows of values, each scaled to its maximum, on a log colour scale (magma),
 * with a colour bar, row labels and a linear x axis. */
#include <math.h>
#include <stdio.h>

#include "cli/plot_canvas.h"
#include "cli/plot_png.h"

static const uint32_t magma[] = {0x000004, 0x3B0F70, 0x8C2981, 0xDE4968, 0xFE9F6D, 0xFCFDBF};
#define N_MAGMA ((int)(sizeof magma / sizeof magma[0]))

/* The colour of v against its row's maximum: log10(v / max) from -decades (darkest) to 0. */
static uint32_t cell_colour(double v, double max, int decades) {
    if (!(v > 0) || !(max > 0)) return magma[0];
    return kvs_plot_gradient(magma, N_MAGMA, 1 + log10(v / max) / decades);
}

/* 1, 2 or 5 times a power of ten: about a sixth of x_end */
static double tick_step(double x_end) {
    double raw = x_end / 6, p = pow(10, floor(log10(raw))), m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
}

static void colour_bar(kvs_canvas *c, int x, int top, int bottom, int decades) {
    for (int y = top; y <= bottom; y++)
        kvs_canvas_rect(c, x, y, x + 24, y, kvs_plot_gradient(magma, N_MAGMA, (double)(bottom - y) / (bottom - top)));
    kvs_canvas_text(c, x - 10, top - 40, "of the", 2, 0, 0x202020);
    kvs_canvas_text(c, x - 10, top - 22, "row max", 2, 0, 0x202020);
    for (int d = 0; d <= decades; d++) {
        int y = top + (bottom - top) * d / decades;
        char buf[16];
        if (d <= 2) snprintf(buf, sizeof buf, "%g", pow(10, -d));
        else snprintf(buf, sizeof buf, "1E-%d", d);
        kvs_canvas_line(c, x + 24, y, x + 30, y, 1, 0x404040);
        kvs_canvas_text(c, x + 38, y - 7, buf, 2, 0, 0x404040);
    }
}

kvs_status kvs_plot_heatmap_png(const char *path, const kvs_plot_heatmap *h) {
    if (h->rows < 1 || h->cols < 1 || h->decades < 1 || !(h->x_end > 0))
        return kvs_fail(KVS_ERR_INVALID, "plot %s: nothing to draw", path);
    int cell_w = h->cols >= 1200 ? 1 : 1200 / h->cols, row_h = 400 / h->rows;
    row_h = row_h < 6 ? 6 : row_h > 48 ? 48 : row_h;
    int left = 110, top = 90, plot_w = cell_w * h->cols, plot_h = row_h * h->rows;
    kvs_canvas c;
    KVS_TRY(kvs_canvas_create(&c, left + plot_w + 170, top + plot_h + 90));
    int right = left + plot_w, bottom = top + plot_h;
    kvs_canvas_text(&c, left, 14, h->title, 2, 0, 0x202020);
    if (h->subtitle) kvs_canvas_text(&c, left, 38, h->subtitle, 2, 0, 0x606060);
    for (int r = 0; r < h->rows; r++) {
        const double *row = h->v + (size_t)r * h->cols;
        double max = 0;
        for (int i = 0; i < h->cols; i++) max = fmax(max, row[i]);
        int y1 = bottom - 1 - r * row_h, y0 = y1 - row_h + 1; /* row 0 at the bottom */
        for (int i = 0; i < h->cols; i++)
            kvs_canvas_rect(&c, left + i * cell_w, y0, left + (i + 1) * cell_w - 1, y1, cell_colour(row[i], max, h->decades));
        char buf[16];
        snprintf(buf, sizeof buf, "%d", r);
        if (row_h >= 16 || r % 4 == 0) kvs_canvas_text(&c, left - 10, (y0 + y1) / 2 - 7, buf, 2, 2, 0x404040);
    }
    kvs_canvas_text(&c, left - 100, top - 24, h->ylabel, 2, 0, 0x202020);
    double step = tick_step(h->x_end);
    for (double x = 0; x <= h->x_end * 1.0001; x += step) {
        int px = left + (int)lround(x / h->x_end * plot_w);
        char buf[32];
        kvs_canvas_number(buf, sizeof buf, x);
        kvs_canvas_line(&c, px, bottom, px, bottom + 6, 2, 0x404040);
        kvs_canvas_text(&c, px, bottom + 12, buf, 2, 1, 0x404040);
    }
    kvs_canvas_text(&c, (left + right) / 2, bottom + 46, h->xlabel, 2, 1, 0x202020);
    if (h->mark_name) {
        int px = left + (int)lround(h->mark_x / h->x_end * plot_w);
        for (int y = top; y < bottom; y += 8) kvs_canvas_line(&c, px, y, px, y + 3 < bottom ? y + 3 : bottom, 2, 0x00D0FF);
        kvs_canvas_text(&c, px, top - 20, h->mark_name, 2, 1, 0x0090C0);
    }
    colour_bar(&c, right + 40, top, bottom, h->decades);
    kvs_status st = kvs_canvas_write_png(&c, path);
    kvs_canvas_free(&c);
    return st;
}
