/* libFuzzer target: compiles the input as a chat template and, when it
 * compiles, renders it with a few messages (both add_generation_prompt values),
 * and once more with tools, an assistant's tool_calls and a tool message.
 * Seed corpus: fuzz/corpus/chat_template/. */
#include <stdint.h>
#include <stdlib.h>

#include "template/template.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvs_chat_template *tpl = NULL;
    if (kvs_chat_template_compile((const char *)data, size, &tpl) != KVS_OK) return 0;
    static const kvs_chat_message msgs[] = {
        { "system", "You are helpful." },
        { "user", "Hi <think>x</think> \xc3\xa9" },
        { "assistant", "<think>\nok\n</think>\n\nHello!" },
        { "user", "" },
    };
    for (int agp = 0; agp < 2; agp++) {
        char *text = NULL;
        if (kvs_chat_template_render(tpl, msgs, 4, agp, "<s>", "</s>", &text) == KVS_OK) free(text);
    }
    static const kvs_chat_message with_tools[] = {
        { "user", "Weather?" },
        { "assistant", "", "[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                           "\"arguments\":{\"city\":\"Paris\",\"days\":[1,2.5],\"ok\":true,\"x\":null}}}]" },
        { "tool", "21 C", NULL, "c1", "get_weather" },
    };
    static const char tools[] = "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":"
                                "\"The weather\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":"
                                "{\"type\":\"string\"}},\"required\":[\"city\"]}}}]";
    char *text = NULL;
    if (kvs_chat_template_render_tools(tpl, with_tools, 3, tools, true, "<s>", "</s>", &text) == KVS_OK) free(text);
    kvs_chat_template_destroy(tpl);
    return 0;
}
