/* cli: the canvas of the PNG charts (plot_canvas.c): an RGB image, its
 * drawing primitives and its PNG file. */
#ifndef KVS_PLOT_CANVAS_H
#define KVS_PLOT_CANVAS_H

#include <stddef.h>
#include <stdint.h>

#include "core/core.h"

typedef struct {
    uint8_t *px; /* [h][w][3] */
    int w, h;
} kvs_canvas;

kvs_status kvs_canvas_create(kvs_canvas *c, int w, int h); /* white */
void kvs_canvas_free(kvs_canvas *c);
kvs_status kvs_canvas_write_png(kvs_canvas *c, const char *path);

/* Colours are 0xRRGGBB; what falls outside the canvas is clipped. */
void kvs_canvas_put_px(kvs_canvas *c, int x, int y, uint32_t rgb);
void kvs_canvas_rect(kvs_canvas *c, int x0, int y0, int x1, int y1, uint32_t rgb); /* filled, corners included */
void kvs_canvas_line(kvs_canvas *c, int x0, int y0, int x1, int y1, int thick, uint32_t rgb);
/* Text with (x, y) its top-left corner, 6 x scale pixels a character;
 * align 0 left, 1 centred on x, 2 ending at x. Lower case is drawn as capitals. */
void kvs_canvas_text(kvs_canvas *c, int x, int y, const char *s, int scale, int align, uint32_t rgb);

/* 1, 2 or 5 times a power of ten, at least v (an axis's top). */
double kvs_canvas_nice_max(double v);
/* An axis label: whole numbers as they are, others to 2 significant digits. */
void kvs_canvas_number(char *buf, size_t cap, double v);

#endif
