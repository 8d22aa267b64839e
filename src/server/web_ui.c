/* server: the chat page of GET / (web_ui.html, assembled into the binary as
 * it is: no build step, nothing fetched at run time). */
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"

/* KVS_WEB_UI_HTML: the page's path (CMakeLists.txt), its bytes then a NUL */
__asm__(".pushsection .rodata\n"
        ".balign 16\n"
        "kvs_web_ui_page:\n"
        ".incbin \"" KVS_WEB_UI_HTML "\"\n"
        ".byte 0\n"
        ".popsection\n");
extern const char kvs_web_ui_page[] __asm__("kvs_web_ui_page");

char *kvs_web_ui_html(void) { return strdup(kvs_web_ui_page); }
