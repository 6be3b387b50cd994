#include <immintrin.h>
#include <stdio.h>
#include <time.h>
int main(){
  __m512 acc[12]; for(int i=0;i<12;i++) acc[i]=_mm512_setzero_ps();
  __m512bh a=(__m512bh)_mm512_set1_epi16(0x3f80), b=(__m512bh)_mm512_set1_epi16(0x3f80);
  long n=200000000; struct timespec t0,t1; clock_gettime(CLOCK_MONOTONIC,&t0);
  for(long i=0;i<n;i+=12){
    #pragma GCC unroll 12
    for(int j=0;j<12;j++){ acc[j]=_mm512_dpbf16_ps(acc[j],a,b); __asm__ volatile(""::"v"(acc[j]));}
  }
  clock_gettime(CLOCK_MONOTONIC,&t1);
  double s=(t1.tv_sec-t0.tv_sec)+(t1.tv_nsec-t0.tv_nsec)*1e-9;
  float r=0; for(int i=0;i<12;i++) r+=_mm512_reduce_add_ps(acc[i]);
  printf("%.1f GFLOPS (%.2f Ginstr/s) %f\n", n*64/s/1e9, n/s/1e9, r);
}
