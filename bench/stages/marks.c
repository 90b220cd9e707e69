/* One call for the stage probes of bench/request_stages.py: under callgrind, dump the instructions counted
 * since the previous dump, labelled with the stage they belong to (a no-op when not run under valgrind). */
#include <valgrind/callgrind.h>

void stage_mark(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
