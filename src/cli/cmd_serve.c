/* placeholder until this command lands */
#include <stdio.h>

#include "cli/cli.h"

int kvs_cmd_serve(int argc, char **argv) {
    fprintf(stderr, "kvsparse: this command is not implemented yet\n");
    return 1;
}
