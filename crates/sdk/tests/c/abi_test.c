/* Exercises include/unbroken.h against the built cdylib and the in-test guard.
 * argv: guard_addr key_hex wrong_key_hex record_hex(128 digits)
 * Prints "ok" and exits 0 on success; prints the failed check and exits 1 otherwise. */
#include "unbroken.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define CHECK(cond)                                                          \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, \
                    #cond);                                                  \
            return 1;                                                        \
        }                                                                    \
    } while (0)

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int main(int argc, char **argv) {
    ub_client *c, *wrong;
    ub_record rec, bad;
    int code, fd = -1;
    size_t i;

    CHECK(argc == 5);
    CHECK(sizeof(ub_record) == UB_RECORD_LEN && UB_RECORD_LEN == 64);
    CHECK(strlen(argv[4]) == 2 * UB_RECORD_LEN);
    for (i = 0; i < UB_RECORD_LEN; i++) {
        int hi = hexval(argv[4][2 * i]), lo = hexval(argv[4][2 * i + 1]);
        CHECK(hi >= 0 && lo >= 0);
        rec.bytes[i] = (uint8_t)(hi << 4 | lo);
    }

    /* Error strings: every code has one, unknown codes too. */
    for (code = 0; code >= -10; code--) {
        const char *s = ub_strerror(code);
        CHECK(s != NULL && s[0] != '\0');
    }
    CHECK(strcmp(ub_strerror(UB_OK), "success") == 0);
    CHECK(strstr(ub_strerror(UB_ETIMEDOUT), "guard") != NULL);
    CHECK(strcmp(ub_strerror(12345), "unknown error code") == 0);

    /* Bad arguments. */
    errno = 0;
    CHECK(ub_client_new(NULL, argv[2]) == NULL);
    CHECK(errno == EINVAL);
    CHECK(ub_client_new("not an address", argv[2]) == NULL);
    CHECK(ub_client_new(argv[1], "0011") == NULL);
    ub_client_free(NULL);

    c = ub_client_new(argv[1], argv[2]);
    CHECK(c != NULL);

    /* ACKNOWLEDGE round trip: the Rust side checks the guard's checkpoint afterwards. */
    CHECK(ub_acknowledge(c, &rec, 100) == UB_OK);
    CHECK(ub_acknowledge(NULL, &rec, 1) == UB_EINVAL);
    CHECK(ub_acknowledge(c, NULL, 1) == UB_EINVAL);
    bad = rec;
    bad.bytes[45] ^= 1;
    CHECK(ub_acknowledge(c, &bad, 1) == UB_ERECORD);
    CHECK(ub_shutdown(c, &rec, 7) == UB_EINVAL);
    CHECK(ub_shutdown(c, &rec, UB_SHUT_WR) == UB_OK);
    CHECK(ub_establish(c, -1, &bad) == UB_EINVAL);
    CHECK(ub_recover(c, &rec, 0, 0, NULL, NULL) == UB_EINVAL);

    /* A client with the wrong key is never answered. */
    wrong = ub_client_new(argv[1], argv[3]);
    CHECK(wrong != NULL);
    CHECK(ub_client_set_timeouts(wrong, 10, 2, 0) == UB_OK);
    CHECK(ub_acknowledge(wrong, &rec, 999) == UB_ETIMEDOUT);
    ub_client_free(wrong);

    /* A listener recovered connections can share a port with. */
    CHECK(ub_listen("127.0.0.1:0", 4, &fd) == UB_OK);
    CHECK(fd >= 0);
    close(fd);
    CHECK(ub_listen("127.0.0.1", 4, &fd) == UB_EINVAL);

    ub_client_free(c);
    printf("ok\n");
    return 0;
}
