// The tutorial's own program (the full listing of its "Latihan" section),
// verbatim except for one change so the bench can run it: the listen address
// comes from the TUTORIAL_ADDR environment variable (the bench passes a free
// port on 127.0.0.1) instead of the hard-coded ":8080", which stays the
// default. That is the `addr` variable below; nothing else differs.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"
)

type Produk struct {
	ID    int    `json:"id"`
	Nama  string `json:"nama"`
	Harga int    `json:"harga"`
}

type EmailJob struct {
	Tujuan string
	Isi    string
}

var (
	mu     sync.Mutex
	produk = []Produk{{ID: 1, Nama: "Kopi Arabika", Harga: 85000}}
)

func kirimEmail(job EmailJob) {
	defer func() {
		if r := recover(); r != nil {
			slog.Error("worker panic", "tujuan", job.Tujuan, "error", r)
		}
	}()
	time.Sleep(2 * time.Second) // simulasi kirim email
	slog.Info("email terkirim", "tujuan", job.Tujuan, "isi", job.Isi)
}

func jalankanRekap(ctx context.Context, interval time.Duration) {
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			slog.Info("job rekap berhenti")
			return
		case <-ticker.C:
			mu.Lock()
			jumlah := len(produk)
			mu.Unlock()
			slog.Info("rekap produk", "jumlah", jumlah)
		}
	}
}

func main() {
	slog.SetDefault(slog.New(slog.NewJSONHandler(os.Stdout, nil)))

	ctx, stop := signal.NotifyContext(context.Background(),
		os.Interrupt, syscall.SIGTERM)
	defer stop()

	jobs := make(chan EmailJob, 100)
	var wg sync.WaitGroup
	for i := 1; i <= 3; i++ {
		wg.Add(1)
		go func(id int) {
			defer wg.Done()
			for job := range jobs {
				slog.Info("worker ambil job", "worker", id, "tujuan", job.Tujuan)
				kirimEmail(job)
			}
		}(i)
	}

	go jalankanRekap(ctx, 30*time.Second)

	mux := http.NewServeMux()
	mux.HandleFunc("POST /produk", func(w http.ResponseWriter, r *http.Request) {
		var p Produk
		if err := json.NewDecoder(r.Body).Decode(&p); err != nil {
			http.Error(w, `{"error":"body tidak valid"}`, http.StatusBadRequest)
			return
		}
		mu.Lock()
		p.ID = len(produk) + 1
		produk = append(produk, p)
		mu.Unlock()

		jobs <- EmailJob{
			Tujuan: "admin@toko.com",
			Isi:    fmt.Sprintf("Produk baru: %s", p.Nama),
		}

		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(p)
	})

	addr := ":8080"
	if v := os.Getenv("TUTORIAL_ADDR"); v != "" {
		addr = v
	}
	server := &http.Server{Addr: addr, Handler: mux}
	go func() {
		slog.Info("server jalan", "addr", addr)
		if err := server.ListenAndServe(); err != nil && err != http.ErrServerClosed {
			slog.Error("server gagal", "error", err)
			os.Exit(1)
		}
	}()

	<-ctx.Done()
	slog.Info("sinyal berhenti diterima")

	shutdownCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	server.Shutdown(shutdownCtx)

	close(jobs)
	wg.Wait()
	slog.Info("semua worker selesai, aplikasi berhenti")
}
