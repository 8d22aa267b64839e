/* cli: PNG line charts (libpng, through plot_canvas.c): `kvsparse bench
 * serve --plot`'s panels, one per series against a shared x axis, and
 * `kvsparse calibrate --plot`'s curves of fractions on a log axis. */
#include <math.h>
#include <stdio.h>

#include "cli/plot_canvas.h"
#include "cli/plot_png.h"

static void panel(kvs_canvas *c, int ox, int oy, int w, int h, const char *title, const char *xlabel, const double *x,
                  const double *y, int n, uint32_t color) {
    int left = ox + 80, right = ox + w - 20, top = oy + 50, bottom = oy + h - 60;
    double xmin = x[0], xmax = x[0], ymax = 0;
    for (int i = 0; i < n; i++) {
        xmin = fmin(xmin, x[i]), xmax = fmax(xmax, x[i]);
        if (isfinite(y[i])) ymax = fmax(ymax, y[i]);
    }
    if (xmax == xmin) xmin -= 1, xmax += 1;
    ymax = kvs_canvas_nice_max(ymax * 1.05);
    kvs_canvas_text(c, (left + right) / 2, oy + 15, title, 2, 1, 0x202020);
    char buf[32];
    for (int t = 0; t <= 5; t++) {
        int py = bottom - (bottom - top) * t / 5;
        kvs_canvas_line(c, left, py, right, py, 1, 0xDDDDDD);
        kvs_canvas_number(buf, sizeof buf, ymax * t / 5);
        kvs_canvas_text(c, left - 8, py - 7, buf, 2, 2, 0x404040);
    }
    for (int i = 0; i < n; i++) {
        int px = left + (int)((x[i] - xmin) / (xmax - xmin) * (right - left));
        kvs_canvas_line(c, px, bottom, px, bottom + 5, 1, 0x404040);
        kvs_canvas_number(buf, sizeof buf, x[i]);
        kvs_canvas_text(c, px, bottom + 10, buf, 2, 1, 0x404040);
    }
    kvs_canvas_line(c, left, top, left, bottom, 2, 0x404040);
    kvs_canvas_line(c, left, bottom, right, bottom, 2, 0x404040);
    kvs_canvas_text(c, (left + right) / 2, oy + h - 25, xlabel, 2, 1, 0x202020);
    int px0 = 0, py0 = 0;
    for (int i = 0; i < n; i++) {
        if (!isfinite(y[i])) continue;
        int px = left + (int)((x[i] - xmin) / (xmax - xmin) * (right - left));
        int py = bottom - (int)(y[i] / ymax * (bottom - top));
        if (i > 0) kvs_canvas_line(c, px0, py0, px, py, 3, color);
        kvs_canvas_rect(c, px - 4, py - 4, px + 4, py + 4, color);
        px0 = px, py0 = py;
    }
}

static kvs_status write_and_free(kvs_canvas *c, const char *path) {
    kvs_status st = kvs_canvas_write_png(c, path);
    kvs_canvas_free(c);
    return st;
}

kvs_status kvs_plot_png(const char *path, const char *xlabel, const double *x, int n, const kvs_plot_series *series,
                        int n_series) {
    if (n < 1 || n_series < 1) return kvs_fail(KVS_ERR_INVALID, "plot: nothing to draw");
    kvs_canvas c;
    KVS_TRY(kvs_canvas_create(&c, 520 * n_series, 420));
    static const uint32_t colors[] = {0x1F77B4, 0xD62728, 0x2CA02C, 0x9467BD};
    for (int s = 0; s < n_series; s++)
        panel(&c, 520 * s, 0, 520, 420, series[s].name, xlabel, x, series[s].y, n, colors[s % 4]);
    return write_and_free(&c, path);
}

/* ---- fraction curves ---------------------------------------------------------- */

uint32_t kvs_plot_gradient(const uint32_t *stops, int n_stops, double t) {
    t = t < 0 ? 0 : t > 1 ? 1 : t;
    double pos = t * (n_stops - 1);
    int i = (int)pos < n_stops - 1 ? (int)pos : n_stops - 2;
    double f = pos - i;
    uint32_t rgb = 0;
    for (int shift = 16; shift >= 0; shift -= 8) {
        double a = (stops[i] >> shift) & 0xFF, b = (stops[i + 1] >> shift) & 0xFF;
        rgb |= (uint32_t)lround(a + (b - a) * f) << shift;
    }
    return rgb;
}

static void dashed_vline(kvs_canvas *c, int x, int y0, int y1, uint32_t rgb) {
    for (int y = y0; y < y1; y += 10) kvs_canvas_line(c, x, y, x, y + 5 < y1 ? y + 5 : y1, 2, rgb);
}

/* "0.5%", "10%" */
static void percent(char *buf, size_t cap, double fraction) {
    double p = round(1000 * fraction) / 10;
    snprintf(buf, cap, p == floor(p) ? "%.0f%%" : "%.1f%%", p);
}

/* The plot area and its log x axis. */
typedef struct {
    int left, right, top, bottom;
    double lx0, lx1; /* log10 of the x range */
} log_axes;

static int xpix(const log_axes *a, double x) {
    return a->left + (int)lround((log10(x) - a->lx0) / (a->lx1 - a->lx0) * (a->right - a->left));
}
static int ypix(const log_axes *a, double y) { return a->bottom - (int)lround(y * (a->bottom - a->top)); }

kvs_status kvs_plot_fraction_curves_png(const char *path, const kvs_plot_curves *k) {
    if (k->n < 2 || k->n_series < 1 || !(k->x[0] > 0) || !(k->x[k->n - 1] > k->x[0]))
        return kvs_fail(KVS_ERR_INVALID, "plot %s: nothing to draw (x must be positive and ascending)", path);
    kvs_canvas c;
    KVS_TRY(kvs_canvas_create(&c, 1100, 680));
    log_axes a = {100, c.w - 190, 70, c.h - 80, log10(k->x[0]), log10(k->x[k->n - 1])};
    int left = a.left, right = a.right, top = a.top, bottom = a.bottom;
    char buf[48];
    kvs_canvas_text(&c, (left + right) / 2, 20, k->title, 2, 1, 0x202020);
    for (int t = 0; t <= 5; t++) { /* y: 0 .. 100% */
        int py = ypix(&a, t / 5.0);
        kvs_canvas_line(&c, left, py, right, py, 1, 0xE0E0E0);
        percent(buf, sizeof buf, t / 5.0);
        kvs_canvas_text(&c, left - 10, py - 7, buf, 2, 2, 0x404040);
    }
    for (int d = (int)floor(a.lx0); d <= (int)ceil(a.lx1); d++) /* x: 1, 2, 5 times the powers of ten inside */
        for (int m = 1; m <= 5; m += m == 1 ? 1 : 3) {
            double v = m * pow(10, d);
            if (v < k->x[0] * 0.999 || v > k->x[k->n - 1] * 1.001) continue;
            int px = xpix(&a, v);
            kvs_canvas_line(&c, px, top, px, bottom, 1, 0xE0E0E0);
            percent(buf, sizeof buf, v);
            kvs_canvas_text(&c, px, bottom + 10, buf, 2, 1, 0x404040);
        }
    for (int i = 0; i < k->n_marks; i++) {
        int px = xpix(&a, k->marks[i]);
        dashed_vline(&c, px, top, bottom, 0x909090);
        kvs_canvas_text(&c, px + 4, top + 4, k->mark_names[i], 2, 0, 0x606060);
    }
    kvs_canvas_line(&c, left, top, left, bottom, 2, 0x404040);
    kvs_canvas_line(&c, left, bottom, right, bottom, 2, 0x404040);
    kvs_canvas_text(&c, (left + right) / 2, c.h - 30, k->xlabel, 2, 1, 0x202020);
    kvs_canvas_text(&c, left - 80, top - 30, k->ylabel, 2, 0, 0x202020);
    static const uint32_t depth[] = {0x440154, 0x3B528B, 0x21918C, 0x5EC962, 0xC8C800};
    for (int s = 0; s < k->n_series; s++) {
        uint32_t col = kvs_plot_gradient(depth, 5, k->n_series > 1 ? (double)s / (k->n_series - 1) : 0);
        for (int i = 1; i < k->n; i++)
            kvs_canvas_line(&c, xpix(&a, k->x[i - 1]), ypix(&a, k->series[s].y[i - 1]), xpix(&a, k->x[i]), ypix(&a, k->series[s].y[i]),
                            3, col);
        int ly = top + 10 + 24 * (k->n_series - 1 - s); /* the legend: the last series on top */
        kvs_canvas_line(&c, right + 20, ly + 7, right + 50, ly + 7, 4, col);
        kvs_canvas_text(&c, right + 60, ly, k->series[s].name, 2, 0, 0x202020);
    }
    return write_and_free(&c, path);
}
