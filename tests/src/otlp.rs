//! An in-process OTLP receiver for the tests: gRPC (tonic, on opentelemetry-proto's generated
//! services) or HTTP/protobuf (a minimal HTTP/1.1 server decoding the same messages), keeping
//! every request it gets.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener},
    sync::{Arc, Mutex},
};

use opentelemetry_proto::tonic::{
    collector::{
        metrics::v1::{
            ExportMetricsServiceRequest, ExportMetricsServiceResponse,
            metrics_service_server::{MetricsService, MetricsServiceServer},
        },
        trace::v1::{
            ExportTraceServiceRequest, ExportTraceServiceResponse,
            trace_service_server::{TraceService, TraceServiceServer},
        },
    },
    common::v1::{AnyValue, KeyValue, any_value},
    metrics::v1::{Metric, metric::Data, number_data_point},
    trace::v1::Span,
};
use prost::Message;

#[derive(Clone, Default)]
pub struct Received {
    pub traces: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
    pub metrics: Arc<Mutex<Vec<ExportMetricsServiceRequest>>>,
}

#[tonic::codegen::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        r: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.traces.lock().unwrap().push(r.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

#[tonic::codegen::async_trait]
impl MetricsService for Received {
    async fn export(
        &self,
        r: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.metrics.lock().unwrap().push(r.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse {
            partial_success: None,
        }))
    }
}

pub struct Receiver {
    pub got: Received,
    pub addr: SocketAddr,
    _rt: Option<tokio::runtime::Runtime>,
}

impl Receiver {
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A gRPC receiver on a free port.
    pub fn grpc() -> Receiver {
        Self::grpc_on(0)
    }

    /// An HTTP/protobuf receiver on a free port.
    pub fn http() -> Receiver {
        Self::http_on(0)
    }

    /// A gRPC receiver on `port` (0: a free one).
    pub fn grpc_on(port: u16) -> Receiver {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let got = Received::default();
        let listener = rt.block_on(tokio::net::TcpListener::bind(("127.0.0.1", port))).unwrap();
        let addr = listener.local_addr().unwrap();
        let (t, m) = (got.clone(), got.clone());
        rt.spawn(async move {
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(t))
                .add_service(MetricsServiceServer::new(m))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        Receiver {
            got,
            addr,
            _rt: Some(rt),
        }
    }

    /// An HTTP/protobuf receiver (`/v1/traces`, `/v1/metrics`) on `port` (0: a free one).
    pub fn http_on(port: u16) -> Receiver {
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let addr = listener.local_addr().unwrap();
        let got = Received::default();
        let g = got.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().map_while(Result::ok) {
                let g = g.clone();
                std::thread::spawn(move || serve_http(conn, &g));
            }
        });
        Receiver { got, addr, _rt: None }
    }

    /// Every span received, with its resource's attributes.
    pub fn spans(&self) -> Vec<(Vec<KeyValue>, Span)> {
        let mut out = Vec::new();
        for req in self.got.traces.lock().unwrap().iter() {
            for rs in &req.resource_spans {
                let res = rs.resource.as_ref().map(|r| r.attributes.clone()).unwrap_or_default();
                for ss in &rs.scope_spans {
                    out.extend(ss.spans.iter().map(|s| (res.clone(), s.clone())));
                }
            }
        }
        out
    }

    /// The metric of this name from the latest export that has it, with its resource.
    pub fn metric(&self, name: &str) -> Option<(Vec<KeyValue>, Metric)> {
        let reqs = self.got.metrics.lock().unwrap();
        for req in reqs.iter().rev() {
            for rm in &req.resource_metrics {
                for sm in &rm.scope_metrics {
                    if let Some(m) = sm.metrics.iter().find(|m| m.name == name) {
                        let res = rm.resource.as_ref().map(|r| r.attributes.clone()).unwrap_or_default();
                        return Some((res, m.clone()));
                    }
                }
            }
        }
        None
    }
}

fn serve_http(conn: std::net::TcpStream, got: &Received) {
    let mut r = BufReader::new(conn.try_clone().unwrap());
    let mut w = conn;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        match path.as_str() {
            "/v1/traces" => got
                .traces
                .lock()
                .unwrap()
                .push(ExportTraceServiceRequest::decode(&body[..]).unwrap()),
            "/v1/metrics" => got
                .metrics
                .lock()
                .unwrap()
                .push(ExportMetricsServiceRequest::decode(&body[..]).unwrap()),
            _ => {}
        }
        let _ = w.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n");
    }
}

/// An attribute's value as a string (ints and doubles printed), or None.
pub fn attr(attrs: &[KeyValue], key: &str) -> Option<String> {
    let v = attrs.iter().find(|kv| kv.key == key)?.value.as_ref()?;
    Some(any(v))
}

fn any(v: &AnyValue) -> String {
    match v.value.as_ref() {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        _ => String::new(),
    }
}

/// (attributes, value) of every number data point of a sum or gauge.
pub fn points(m: &Metric) -> Vec<(Vec<KeyValue>, f64)> {
    let dps = match &m.data {
        Some(Data::Sum(s)) => &s.data_points,
        Some(Data::Gauge(g)) => &g.data_points,
        _ => return Vec::new(),
    };
    dps.iter()
        .map(|p| {
            let v = match p.value {
                Some(number_data_point::Value::AsDouble(d)) => d,
                Some(number_data_point::Value::AsInt(i)) => i as f64,
                None => f64::NAN,
            };
            (p.attributes.clone(), v)
        })
        .collect()
}

/// (attributes, count, sum) of every histogram data point.
pub fn histogram_points(m: &Metric) -> Vec<(Vec<KeyValue>, u64, f64)> {
    match &m.data {
        Some(Data::Histogram(h)) => h
            .data_points
            .iter()
            .map(|p| (p.attributes.clone(), p.count, p.sum.unwrap_or(0.0)))
            .collect(),
        _ => Vec::new(),
    }
}
