//! cg-bench-rls: Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService`)
//! on the Limitador library, with its counters in Redis: the incumbent `make bench` measures
//! coordination-guard beside (Envoy's `ratelimit` HTTP filter calling this service over gRPC
//! for every request).
//!
//! `cg-bench-rls PORT REDIS_URL exact|cached LIMIT SECONDS` serves on 127.0.0.1:PORT one limit
//! of LIMIT hits per SECONDS per value of the first descriptor's `tenant` entry, in the
//! descriptor's domain. `exact` keeps every counter in Redis and checks it there on every
//! request (Limitador's `redis` storage); `cached` counts in memory and flushes to Redis in the
//! background (its `redis_cached` storage, with Limitador's default flushing period, batch size
//! and cache size).

use std::collections::HashMap;
use std::process::ExitCode;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use limitador::limit::{Context, Expression, Limit};
use limitador::storage::redis::{AsyncRedisStorage, CachedRedisStorageBuilder};
use limitador::storage::AsyncCounterStorage;
use limitador::AsyncRateLimiter;
use tonic::{Request, Response, Status};

/// The namespace (Envoy's rate limit domain) the limit is in.
const DOMAIN: &str = "bench";

struct Service {
    limiter: AsyncRateLimiter,
}

/// The request's descriptors as Limitador's context sees them: `descriptors`, a list of maps
/// from entry key to value (the binding its server gives limits' variables).
fn context(descriptors: &[RateLimitDescriptor]) -> Context<'static> {
    let mut ctx = Context::default();
    let maps = descriptors
        .iter()
        .map(|d| {
            d.entries
                .iter()
                .map(|e| (e.key.clone(), e.value.clone()))
                .collect::<HashMap<_, _>>()
        })
        .collect();
    ctx.list_binding("descriptors".to_string(), maps);
    ctx
}

#[tonic::async_trait]
impl RateLimitService for Service {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.into_inner();
        let ctx = context(&req.descriptors);
        let hits = u64::from(req.hits_addend.max(1));
        let checked = self
            .limiter
            .check_rate_limited_and_update(&req.domain.as_str().into(), &ctx, hits)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let code = if checked.limited {
            Code::OverLimit
        } else {
            Code::Ok
        };
        let statuses = req
            .descriptors
            .iter()
            .map(|_| DescriptorStatus {
                code: code as i32,
                ..Default::default()
            })
            .collect();
        Ok(Response::new(RateLimitResponse {
            overall_code: code as i32,
            statuses,
            ..Default::default()
        }))
    }
}

struct Args {
    port: u16,
    redis_url: String,
    cached: bool,
    limit: u64,
    seconds: u64,
}

fn parse_args(argv: &[String]) -> Result<Args, String> {
    let [_, port, redis_url, mode, limit, seconds] = argv else {
        return Err("usage: cg-bench-rls PORT REDIS_URL exact|cached LIMIT SECONDS".into());
    };
    let number = |name: &str, raw: &str| -> Result<u64, String> {
        raw.parse()
            .map_err(|_| format!("{name}: not a number: {raw:?}"))
    };
    Ok(Args {
        port: u16::try_from(number("PORT", port)?).map_err(|_| format!("PORT: {port:?}"))?,
        redis_url: redis_url.clone(),
        cached: match mode.as_str() {
            "exact" => false,
            "cached" => true,
            other => return Err(format!("mode: exact or cached, not {other:?}")),
        },
        limit: number("LIMIT", limit)?,
        seconds: number("SECONDS", seconds)?,
    })
}

async fn serve(args: Args) -> Result<(), String> {
    let storage: Box<dyn AsyncCounterStorage> = if args.cached {
        let cached = CachedRedisStorageBuilder::new(&args.redis_url)
            .build()
            .await
            .map_err(|e| format!("redis {}: {e}", args.redis_url))?;
        Box::new(cached)
    } else {
        let exact = AsyncRedisStorage::new(&args.redis_url)
            .await
            .map_err(|e| format!("redis {}: {e}", args.redis_url))?;
        Box::new(exact)
    };
    let limiter = AsyncRateLimiter::new_with_storage(storage);
    let tenant = Expression::parse("descriptors[0].tenant").map_err(|e| e.to_string())?;
    limiter.add_limit(Limit::new(DOMAIN, args.limit, args.seconds, [], [tenant]));
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], args.port));
    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(Service { limiter }))
        .serve(addr)
        .await
        .map_err(|e| format!("serve on {addr}: {e}"))
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    let result = parse_args(&argv).and_then(|args| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("tokio runtime: {e}"))?
            .block_on(serve(args))
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cg-bench-rls: {e}");
            ExitCode::FAILURE
        }
    }
}
