/* A PNG line chart for `kvsparse bench serve --plot` (plot_png.c, libpng). */
#ifndef KVS_PLOT_PNG_H
#define KVS_PLOT_PNG_H

#include "core/core.h"

typedef struct {
    const char *name; /* panel title: digits, capitals, '.', '/', '-' */
    const double *y;  /* [n] */
} kvs_plot_series;
/* One panel per series, side by side, against the shared x values. */
kvs_status kvs_plot_png(const char *path, const char *xlabel, const double *x, int n, const kvs_plot_series *series,
                        int n_series);

#endif
