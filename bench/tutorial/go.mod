// The bench builds this with the Go toolchain from the bench extra, offline:
// standard library only. go >= 1.22 for the "POST /produk" mux pattern.
module toko.bench/tutorial

go 1.22
