# Least privilege for the jobs that use the store, limited to the run prefix.
#
# What ckptstore's S3 backend calls, and the permission each needs:
#   ListObjectsV2 under the prefix (list steps, find manifests)  s3:ListBucket + s3:prefix
#   GetObject / HeadObject                                       s3:GetObject
#   PutObject (conditional: If-None-Match / If-Match), the
#     multipart upload calls, CopyObject / UploadPartCopy target  s3:PutObject
#   DeleteObjects (retention, the capability probe)              s3:DeleteObject
#   AbortMultipartUpload (failed uploads, gc)                    s3:AbortMultipartUpload
#   ListMultipartUploads (gc)                                    s3:ListBucketMultipartUploads
#   SSE-KMS: new data keys for writes, decrypt for reads and
#     for multipart uploads                                     kms:GenerateDataKey, kms:Decrypt
# Conditional writes need no permission beyond s3:PutObject.

locals {
  objects_arn = "${aws_s3_bucket.this.arn}/${var.run_prefix}/*"
  # ListObjectsV2 must name a prefix inside the run prefix; HeadObject of a missing key is
  # then answered 404 (S3 checks s3:ListBucket with the key as s3:prefix), not 403.
  list_prefixes = ["${var.run_prefix}/", "${var.run_prefix}/*"]
}

data "aws_iam_policy_document" "training" {
  statement {
    sid       = "ListRunPrefix"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = local.list_prefixes
    }
  }

  statement {
    sid = "ReadWriteRunPrefix"
    actions = [
      "s3:AbortMultipartUpload",
      "s3:DeleteObject",
      "s3:GetObject",
      "s3:PutObject",
    ]
    resources = [local.objects_arn]
  }

  # ListMultipartUploads takes no s3:prefix condition key: this is the one bucket-wide grant.
  # It shows the keys and upload IDs of unfinished uploads, never object data. `ckptstore gc`
  # needs it; without it the lifecycle rule still aborts strays after a day.
  statement {
    sid       = "FindUnfinishedUploads"
    actions   = ["s3:ListBucketMultipartUploads"]
    resources = [aws_s3_bucket.this.arn]
  }

  statement {
    sid       = "UseBucketKeyThroughS3"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.this.arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = [local.s3_service]
    }
  }
}

data "aws_iam_policy_document" "read_only" {
  statement {
    sid       = "ListRunPrefix"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = local.list_prefixes
    }
  }

  statement {
    sid       = "ReadRunPrefix"
    actions   = ["s3:GetObject"]
    resources = [local.objects_arn]
  }

  statement {
    sid       = "DecryptThroughS3"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = [local.s3_service]
    }
  }
}

resource "aws_iam_policy" "training" {
  name        = "${local.iam_name}-train"
  description = "ckptstore: read, write and delete checkpoints under s3://${var.bucket_name}/${var.run_prefix}"
  policy      = data.aws_iam_policy_document.training.json
  tags        = var.tags
}

resource "aws_iam_policy" "read_only" {
  name        = "${local.iam_name}-read"
  description = "ckptstore: read checkpoints under s3://${var.bucket_name}/${var.run_prefix}"
  policy      = data.aws_iam_policy_document.read_only.json
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "training" {
  for_each   = toset(var.training_role_names)
  role       = each.value
  policy_arn = aws_iam_policy.training.arn
}

resource "aws_iam_role_policy_attachment" "read_only" {
  for_each   = toset(var.read_only_role_names)
  role       = each.value
  policy_arn = aws_iam_policy.read_only.arn
}
