/* examples/embed.c: kvsparse as a library. Loads a model folder, asks one
 * question, prints the answer as it is generated, then what the KV cache kept.
 *
 *   make install PREFIX=$HOME/.local
 *   PKG_CONFIG_PATH=$HOME/.local/lib/pkgconfig cc examples/embed.c $(pkg-config --cflags --libs kvsparse) -o embed
 *   LD_LIBRARY_PATH=$HOME/.local/lib ./embed models/tiny-needle-llama "What is ...?"
 */
#include <kvsparse.h>
#include <stdio.h>

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL_DIR [PROMPT]\n", argv[0]);
        return 2;
    }
    const char *prompt = argc > 2 ? argv[2]
                                  : "The access code for Marigold is 48213. The sky was grey over the harbour. "
                                    "What is the access code for Marigold?";
    kvsparse_options o;
    kvsparse_options_init(&o);
    o.quiet = 1;
    kvsparse_engine *e;
    if (kvsparse_create(argv[1], &o, &e) != KVSPARSE_OK) {
        fprintf(stderr, "kvsparse_create: %s\n", kvsparse_last_error());
        return 1;
    }
    kvsparse_request r;
    kvsparse_request_init(&r);
    r.prompt = prompt;
    r.chat = 1;        /* through the model's chat template */
    r.max_tokens = 32; /* sampling: the model's defaults (this one's generation_config.json: greedy) */
    kvsparse_stream *s;
    if (kvsparse_submit_stream(e, &r, &s) != KVSPARSE_OK) {
        fprintf(stderr, "kvsparse_submit_stream: %s\n", kvsparse_last_error());
        kvsparse_destroy(e);
        return 1;
    }
    kvsparse_output out;
    int rc = 0;
    while (kvsparse_stream_next(s, &out) == KVSPARSE_OK) {
        fwrite(out.text, 1, out.text_len, stdout);
        fflush(stdout);
        if (out.finish == KVSPARSE_FINISH_NONE) continue;
        printf("\n");
        if (out.finish == KVSPARSE_FINISH_ERROR) {
            fprintf(stderr, "error: %s\n", out.error);
            rc = 1;
        }
        fprintf(stderr, "%d prompt tokens, %d generated, KV compression %.2fx\n", out.prompt_tokens,
                out.completion_tokens, out.compression_ratio);
        break;
    }
    kvsparse_stream_close(s);
    kvsparse_destroy(e);
    return rc;
}
