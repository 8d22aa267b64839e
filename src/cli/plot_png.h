/* PNG charts (libpng): `kvsparse bench serve --plot`'s line panels
 * (plot_png.c) and `kvsparse calibrate --plot`'s curves (plot_png.c) and
 * heatmap (plot_heatmap.c). Text is drawn in capitals: digits, letters and
 * a little punctuation (plot_canvas.c). */
#ifndef KVS_PLOT_PNG_H
#define KVS_PLOT_PNG_H

#include <stdbool.h>
#include <stdint.h>

#include "core/core.h"

typedef struct {
    const char *name; /* panel title / legend entry */
    const double *y;  /* [n] */
} kvs_plot_series;
/* One panel per series, side by side, against the shared x values. */
kvs_status kvs_plot_png(const char *path, const char *xlabel, const double *x, int n, const kvs_plot_series *series,
                        int n_series);

/* Curves of fractions on one panel: y in [0, 1] against x in (0, 1] on a log
 * axis (ascending), both shown as percentages; the series coloured from dark
 * (the first) to light (the last), a legend entry each; dashed vertical
 * marks at marks[i] named mark_names[i]. */
typedef struct {
    const char *title, *xlabel, *ylabel;
    const double *x;
    int n;
    const kvs_plot_series *series;
    int n_series;
    const double *marks;
    const char *const *mark_names;
    int n_marks;
} kvs_plot_curves;
kvs_status kvs_plot_fraction_curves_png(const char *path, const kvs_plot_curves *c);

/* A heatmap of rows x cols values >= 0 (row 0 at the bottom, labelled by its
 * index), each row scaled to its own maximum, coloured on a log scale down to
 * 10^-decades of it (below, and zeros: the darkest colour), with a colour
 * bar; columns are equal bins of an x axis from 0 to x_end; a dashed
 * vertical mark at mark_x when mark_name is set. */
typedef struct {
    const char *title, *subtitle, *xlabel, *ylabel;
    const double *v; /* [rows][cols] */
    int rows, cols;
    double x_end;
    int decades;
    double mark_x;
    const char *mark_name;
} kvs_plot_heatmap;
kvs_status kvs_plot_heatmap_png(const char *path, const kvs_plot_heatmap *h);

/* The colour at t in [0, 1] along n_stops >= 2 evenly spaced 0xRRGGBB stops. */
uint32_t kvs_plot_gradient(const uint32_t *stops, int n_stops, double t);

#endif
